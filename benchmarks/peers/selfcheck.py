"""Self-check of the peers: tp=2 against tp=1, and both against oases' own GPT.

    .venv/bin/python -m benchmarks.peers.selfcheck            # both peers
    .venv/bin/python -m benchmarks.peers.selfcheck --peers dtensor

For each peer, runs ``torchrun --standalone --nproc_per_node={1,2}`` on a tiny shape
(d 128, 2 layers, 4 heads, seq 64, mbs 4, 5 steps) twice: once on fresh random batches
(the benchmark's data) and once with ``--fixed-batch`` (one batch, memorised: the loss must
fall). Checks, per peer:

  * every loss is finite;
  * with --fixed-batch the loss falls (last < first);
  * the step-1 loss at tp=2 equals the one at tp=1 within 1e-4 (and every later step is
    reported too);
  * the initial full (gathered) weights at tp=2 equal those at tp=1 (deterministic init);
  * the step-1 gradient norm (before clipping) at tp=2 equals the one at tp=1 (relative 1e-4);
  * oases' GPT (oases.models.build_model, tp=1) loaded with the peer's initial weights gives the
    peer's step-1 loss within 1e-4 and its gradient norm within a relative 1e-4 on the same
    batch, and has the same parameter count:
    the peer is the same function as oases' model, not just the same size.

Exit status 0 when every check passes; prints a table and writes selfcheck.json in --out.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

SHAPE = dict(d_model=128, n_layer=2, n_head=4, seq_len=64, micro_batch_size=4, steps=5)
PEERS = {"dtensor": "benchmarks.peers.dtensor_gpt", "megatron": "benchmarks.peers.megatron_core_gpt"}


def run_peer(script: str, tp: int, out: Path, tag: str, fixed: bool) -> dict:
    js, init = out / f"{tag}.json", out / f"{tag}.init.pt"
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", f"--nproc_per_node={tp}", "--module", script,
           *[f"--{k.replace('_', '-')}={v}" for k, v in SHAPE.items()],
           "--warmup=1", "--vocab=256", f"--out-json={js}", f"--dump-init={init}"]
    if fixed:
        cmd.append("--fixed-batch")
    print("$", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if r.returncode:
        print(r.stdout[-4000:], r.stderr[-8000:], sep="\n")
        raise SystemExit(f"{script} tp={tp} failed with exit status {r.returncode}")
    res = json.loads(js.read_text())
    res["_init"] = str(init)
    return res


def oases_loss(init_path: str) -> tuple[float, float, int]:
    """oases' GPT at tp=1 with the peer's weights: loss and gradient norm on the step-0
    batch, and the parameter count."""
    from benchmarks.peers.common import batch
    from oases.models import build_model
    from oases.config import load_config
    from oases.runtime.optim import grad_norm

    cfg = load_config(None, ["model.name=gpt-tiny", f"model.n_layer={SHAPE['n_layer']}",
                             f"model.d_model={SHAPE['d_model']}",
                             f"model.n_head={SHAPE['n_head']}",
                             f"model.n_kv_heads={SHAPE['n_head']}",
                             f"model.ffn_hidden={4 * SHAPE['d_model']}",
                             f"model.seq_len={SHAPE['seq_len']}", "model.vocab_size=256"]
                      ).validate(1)
    model = build_model(cfg.model, cfg.padded_vocab_size, None, None, "none", seed=0)
    peer = torch.load(init_path)
    nh, d = SHAPE["n_head"], SHAPE["d_model"]
    hd = d // nh
    sd = {}
    for k, v in peer.items():
        if k.startswith("head."):
            continue  # tied to wte
        if k == "wte.weight":
            k = "embed.wte.weight"
        elif k in ("wpe", "wpe.weight"):
            k = "embed.wpe"
        elif ".attn.qkv." in k:  # peers: rows (head, {q,k,v}, hd); oases: (q | k | v)
            v = v.reshape(nh, 3, hd, *v.shape[1:]).transpose(0, 1).reshape(v.shape)
        sd[k] = v
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    args = argparse.Namespace(vocab=256, micro_batch_size=SHAPE["micro_batch_size"],
                              seq_len=SHAPE["seq_len"], fixed_batch=False)
    x, y = batch(0, args, 1234)
    loss = model(x, y)
    loss.backward()
    return float(loss.detach()), float(grad_norm(model, None)), model.num_params()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", nargs="+", default=list(PEERS), choices=list(PEERS))
    p.add_argument("--out", default="/tmp/oases_peers_selfcheck")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    report, ok = {}, True
    for name in a.peers:
        runs = {(tp, fixed): run_peer(PEERS[name], tp, out, f"{name}_tp{tp}_{'fixed' if fixed else 'random'}", fixed)
                for tp in (1, 2) for fixed in (False, True)}
        r1, r2 = runs[(1, False)], runs[(2, False)]
        f1, f2 = runs[(1, True)], runs[(2, True)]
        w1, w2 = torch.load(r1["_init"]), torch.load(r2["_init"])
        init_diff = max((w1[k] - w2[k]).abs().max().item() for k in w1)
        ref_loss, ref_norm, ref_params = oases_loss(r1["_init"])
        rep = {
            "version": r1["versions"],
            "losses_tp1": r1["losses"], "losses_tp2": r2["losses"],
            "fixed_losses_tp1": f1["losses"], "fixed_losses_tp2": f2["losses"],
            "step1_abs_diff_tp2_vs_tp1": abs(r1["losses"][0] - r2["losses"][0]),
            "max_abs_diff_all_steps": max(abs(x - y) for x, y in zip(r1["losses"], r2["losses"])),
            "init_max_abs_diff_tp2_vs_tp1": init_diff,
            "oases_loss_same_weights": ref_loss,
            "step1_abs_diff_vs_oases": abs(ref_loss - r1["losses"][0]),
            "grad_norms_tp1": r1["grad_norms"], "grad_norms_tp2": r2["grad_norms"],
            "oases_grad_norm_same_weights": ref_norm,
            "step1_grad_norm_rel_diff_tp2_vs_tp1":
                abs(r1["grad_norms"][0] - r2["grad_norms"][0]) / r1["grad_norms"][0],
            "step1_grad_norm_rel_diff_vs_oases": abs(ref_norm - r1["grad_norms"][0]) / ref_norm,
            "n_params": r1["n_params"], "oases_n_params": ref_params,
        }
        checks = {
            "finite": all(math.isfinite(v) for r in runs.values() for v in r["losses"]),
            "fixed_batch_loss_falls": f1["losses"][-1] < f1["losses"][0]
                                      and f2["losses"][-1] < f2["losses"][0],
            "step1_tp2_eq_tp1_1e-4": rep["step1_abs_diff_tp2_vs_tp1"] < 1e-4,
            "init_deterministic_across_tp": init_diff == 0.0,
            "same_function_as_oases_1e-4": rep["step1_abs_diff_vs_oases"] < 1e-4,
            "step1_grad_norm_tp2_eq_tp1_rel_1e-4": rep["step1_grad_norm_rel_diff_tp2_vs_tp1"] < 1e-4,
            "step1_grad_norm_eq_oases_rel_1e-4": rep["step1_grad_norm_rel_diff_vs_oases"] < 1e-4,
            "same_param_count_as_oases": rep["n_params"] == ref_params,
        }
        rep["checks"] = checks
        ok &= all(checks.values())
        report[name] = rep
        print(f"\n== {name} ({r1['peer']}, {r1['versions']})")
        print("  random batches  tp1:", " ".join(f"{v:.6f}" for v in r1["losses"]))
        print("                  tp2:", " ".join(f"{v:.6f}" for v in r2["losses"]))
        print("  fixed batch     tp1:", " ".join(f"{v:.6f}" for v in f1["losses"]))
        print("                  tp2:", " ".join(f"{v:.6f}" for v in f2["losses"]))
        print(f"  step-1 |tp2-tp1| = {rep['step1_abs_diff_tp2_vs_tp1']:.2e}   "
              f"max over steps = {rep['max_abs_diff_all_steps']:.2e}   "
              f"init max |tp2-tp1| = {init_diff:.1e}")
        print("  grad norm       tp1:", " ".join(f"{v:.6f}" for v in r1["grad_norms"]))
        print("                  tp2:", " ".join(f"{v:.6f}" for v in r2["grad_norms"]))
        print(f"  oases GPT with these weights: loss {ref_loss:.6f} grad norm {ref_norm:.6f} "
              f"(|diff| {rep['step1_abs_diff_vs_oases']:.2e}); params {rep['n_params']} "
              f"vs oases {ref_params}")
        for k, v in checks.items():
            print(f"  {'PASS' if v else 'FAIL'}  {k}")
    (out / "selfcheck.json").write_text(json.dumps(report, indent=1))
    print(f"\n{'all checks passed' if ok else 'SOME CHECKS FAILED'}; wrote {out / 'selfcheck.json'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
