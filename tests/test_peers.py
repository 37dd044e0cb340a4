"""The benchmarks' TP peers train the same function as oases' GPT.

``benchmarks.overlap`` times oases against two external implementations of the same
model (``benchmarks/peers/``: torch's DTensor TP, and megatron-core's TP layers; neither
imports oases). A comparison means something only if they are the same model, so for
each peer, on a tiny shape (d 128, 2 layers, 4 heads, seq 64, micro-batch 4, 5 steps,
vocab 256), trained at tp 1 and tp 2 on random batches and on one batch memorised:

* every loss is finite, and the memorised batch's loss falls at both degrees;
* the initial full weights are the same at tp 2 as at tp 1, exactly (deterministic init);
* the step-1 loss and gradient norm (before clipping) at tp 2 are tp 1's;
* oases' GPT (``build_model``, tp 1) loaded with the peer's initial weights gives the
  peer's step-1 loss and gradient norm on the same batch, and has as many parameters.

Tolerances: 1e-4 on a loss of ~5.6 (2e-5 relative) and 1e-4 relative on a gradient norm.
Both sides compute the same fp32 function with other GEMM groupings (fused or split QKV,
a TP all-reduce's summation order), which moves a loss by ~1e-6; a wrong layout, mask,
tie or init rule moves it by 1e-2 or more.

The peers run as ``torchrun --module`` runs them, each rank a process forked from the
suite's forkserver (:func:`tests.support.forked_runs.train_forked` with ``module=``).
The megatron-core case needs ``megatron-core`` (the ``bench`` extra) and skips without it.
"""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from tests.support.forked_runs import free_port, train_forked

pytestmark = pytest.mark.slow

SHAPE = dict(d_model=128, n_layer=2, n_head=4, seq_len=64, micro_batch_size=4, steps=5)
PEERS = {"dtensor": ("benchmarks.peers.dtensor_gpt", None),
         "megatron": ("benchmarks.peers.megatron_core_gpt", "megatron.core")}


def run_peer(module: str, tp: int, out, fixed: bool) -> dict:
    tag = f"tp{tp}_{'fixed' if fixed else 'random'}"
    js, init = out / f"{tag}.json", out / f"{tag}.init.pt"
    args = [*(f"--{k.replace('_', '-')}={v}" for k, v in SHAPE.items()), "--warmup=1",
            "--vocab=256", f"--out-json={js}", f"--dump-init={init}",
            *(["--fixed-batch"] if fixed else [])]
    env = {"MASTER_PORT": str(free_port())} if tp == 1 else None  # a world of one's own port
    train_forked(args, nproc=tp, module=module, env=env, timeout=180)
    return {**json.loads(js.read_text()), "init": torch.load(init)}


def oases_step1(peer_init: dict) -> tuple[float, float, int]:
    """oases' GPT at tp 1 with the peer's initial weights: the loss and gradient norm on
    the peer's step-1 batch, and the parameter count."""
    from benchmarks.peers.common import batch
    from oases.config import load_config
    from oases.models import build_model
    from oases.runtime.optim import grad_norm

    s = SHAPE
    cfg = load_config(None, ["model.name=gpt-tiny", f"model.n_layer={s['n_layer']}",
                             f"model.d_model={s['d_model']}", f"model.n_head={s['n_head']}",
                             f"model.n_kv_heads={s['n_head']}",
                             f"model.ffn_hidden={4 * s['d_model']}",
                             f"model.seq_len={s['seq_len']}", "model.vocab_size=256"]
                      ).validate(1)
    model = build_model(cfg.model, cfg.padded_vocab_size, None, None, "none", seed=0)
    nh, hd = s["n_head"], s["d_model"] // s["n_head"]
    sd = {}
    for k, v in peer_init.items():
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
    x, y = batch(0, argparse.Namespace(vocab=256, micro_batch_size=s["micro_batch_size"],
                                       seq_len=s["seq_len"], fixed_batch=False), 1234)
    loss = model(x, y)
    loss.backward()
    return float(loss.detach()), float(grad_norm(model, None)), model.num_params()


@pytest.mark.parametrize("name", list(PEERS))
def test_peer_is_oases_gpt(name, tmp_path):
    module, needs = PEERS[name]
    if needs:
        pytest.importorskip(needs, reason=f"the {name} peer needs {needs} (the bench extra)")
    runs = {(tp, fixed): run_peer(module, tp, tmp_path, fixed)
            for tp in (1, 2) for fixed in (False, True)}
    r1, r2 = runs[(1, False)], runs[(2, False)]
    assert all(math.isfinite(v) for r in runs.values() for v in r["losses"])
    for tp in (1, 2):
        fixed = runs[(tp, True)]["losses"]
        assert fixed[-1] < fixed[0], f"tp {tp}: a memorised batch's loss must fall: {fixed}"
    for k, w in r1["init"].items():
        assert torch.equal(w, r2["init"][k]), f"{k}: initial weights differ at tp 2"
    assert abs(r1["losses"][0] - r2["losses"][0]) < 1e-4, (r1["losses"], r2["losses"])
    n1, n2 = r1["grad_norms"][0], r2["grad_norms"][0]
    assert abs(n1 - n2) / n1 < 1e-4, (r1["grad_norms"], r2["grad_norms"])
    loss, norm, n_params = oases_step1(r1["init"])
    assert abs(loss - r1["losses"][0]) < 1e-4, f"oases {loss} against the peer {r1['losses'][0]}"
    assert abs(norm - n1) / norm < 1e-4, f"oases grad norm {norm} against the peer {n1}"
    assert r1["n_params"] == n_params
