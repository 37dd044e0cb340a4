"""A host-bound step: megatron+full against oases+fine on a tiny model, tp=2 over loopback.

    .venv/bin/python -m benchmarks.host_bound                 # ~4 min on a quiet 2-core machine
    .venv/bin/python -m benchmarks.host_bound --rounds 5 --steps 30

Two ranks on this machine (``torchrun --standalone``, gloo over loopback, one intra-op
thread each) train a tiny GPT (``--model`` overrides: d_model 64, 2 layers, seq 32,
micro-batch 4) on synthetic tokens: its compute is next to nothing, so a step's time is
the host's work and each collective's fixed cost. There a split into sub-batches cannot
pay (it issues every collective once per sub-batch and hides next to nothing), and
``parallel.sub_batches=auto`` should find that and run one. Modes (``--modes``):

    megatron+full   blocking all-reduces, full per-layer recompute (the baseline)
    oases+fine      fine recompute, parallel.sub_batches=auto (chosen at start-up)
    oases+fine+1    fine recompute, one sub-batch
    oases+fine+2    fine recompute, two sub-batches

Each run is fresh processes (``train.py``, every step logged); its figure is the median
``step_time_s`` of steps ``--warmup``+1 .. ``--steps``, and a mode's figure the median
over ``--rounds`` rounds, the modes interleaved round-robin. The target: oases+fine
(auto) takes at most 1.05x megatron+full's step time. No root needed.

Writes ``benchmarks/results/host_bound.{md,json}``.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib import driver
from benchmarks.lib.train_run import metrics

MODES = {
    "megatron+full": ["parallel.schedule=megatron", "parallel.recompute=full"],
    "oases+fine": ["parallel.schedule=oases", "parallel.recompute=fine"],
    "oases+fine+1": ["parallel.schedule=oases", "parallel.recompute=fine",
                     "parallel.sub_batches=1"],
    "oases+fine+2": ["parallel.schedule=oases", "parallel.recompute=fine",
                     "parallel.sub_batches=2"],
}
MODEL = ["model.name=gpt-tiny", "model.d_model=64", "model.n_layer=2", "model.n_head=4",
         "model.n_kv_heads=4", "model.ffn_hidden=256", "model.seq_len=32",
         "model.vocab_size=256", "model.dropout=0", "train.micro_batch_size=4"]
TARGET = ("oases+fine", "megatron+full", 1.05)


def run_once(work: str, mode: str, args) -> dict:
    out = Path(tempfile.mkdtemp(dir=work))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "train.py", *MODEL, *MODES[mode], "parallel.tp=2", "data.kind=synthetic",
           "train.precision=fp32", f"train.steps={args.steps}", "train.log_interval=1",
           "train.warmup_steps=0", "eval.interval=0", "data.val_path=", "wandb.mode=disabled",
           "checkpoint.interval=0", "checkpoint.save_final=false", "resume=none",
           "metrics.comm_clock=false", f"out_dir={out}"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=driver.REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=600)
    rec: dict = {"wall_s": time.monotonic() - t0}
    if proc.returncode:
        return {**rec, "error": (proc.stdout + proc.stderr)[-600:]}
    rec["step_time_s"] = statistics.median(r["step_time_s"] for r in metrics(out)
                                           if "step_time_s" in r and r["step"] > args.warmup)
    chosen = re.search(r"(\d+) sub-batch(?:es)? \(auto, ([^)]*)\)", proc.stdout)
    if chosen:
        rec["auto"] = {"sub_batches": int(chosen.group(1)), "why": chosen.group(2)}
    return rec


def render(prefix: Path, data: dict) -> None:
    meta, per = data["meta"], data["modes"]
    lines = [*driver.report_head("# A host-bound step: oases+fine against megatron+full", meta),
             f"Two ranks on this machine (torchrun --standalone, gloo over loopback, one "
             f"intra-op thread each), tp=2, fp32, synthetic tokens; model: "
             f"{', '.join(s.split('.', 1)[1] for s in MODEL)}. A run's figure: the median step "
             f"time of steps {meta['warmup'] + 1}..{meta['steps']}; a mode's: the median of "
             f"{meta['rounds']} rounds, modes interleaved.", "",
             "| mode | step (ms) | per round (ms) | vs megatron+full |", "|---|---|---|---|"]
    base = per.get("megatron+full", {}).get("step_time_s")
    for mode, r in per.items():
        if not r.get("ok"):
            lines.append(f"| {mode} | failed: {r.get('error', '')[:80]} | | |")
            continue
        rounds = r["rounds"]["step_time_s"] if "step_time_s" in r["rounds"] else r["rounds"]
        rounds = ", ".join(f"{1e3 * t:.1f}" for t in rounds)
        vs = f"{r['step_time_s'] / base:.3f}x" if base else "n/a"
        lines.append(f"| {mode} | {1e3 * r['step_time_s']:.1f} | {rounds} | {vs} |")
    num, den, limit = TARGET
    if per.get(num, {}).get("ok") and base:
        ratio = per[num]["step_time_s"] / base
        lines += ["", f"Target: {num} (sub_batches=auto) step time <= {limit:.2f}x {den}'s: "
                      f"**{ratio:.3f}x {'PASS' if ratio <= limit else 'FAIL'}**."]
    auto = [r["auto"] for r in data["runs"] if r.get("auto")]
    if auto:
        counts = sorted({a["sub_batches"] for a in auto})
        lines += ["", f"What `sub_batches=auto` chose in the {len(auto)} oases+fine runs: "
                      f"{', '.join(map(str, counts))} (e.g. `{auto[0]['why']}`)."]
    loads = [r["loadavg_1min_before"] for r in data["runs"]]
    lines += ["", *driver.load_line(loads, "Machine load (1-min load average before each "
                                           "run):"), "", "Raw numbers: `host_bound.json`."]
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")


def _flags(p) -> None:
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of a run's median")


SUITE = driver.Suite("host_bound", "benchmarks.host_bound", MODES, run_once, render,
                     flags=_flags, setup=lambda args: tempfile.TemporaryDirectory())


if __name__ == "__main__":
    raise SystemExit(driver.run_suite(SUITE, __doc__))
