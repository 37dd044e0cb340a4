"""One transformer layer's forward and backward on CPU, eager against ``parallel.compile``.

    .venv/bin/python -m benchmarks.compile_block                 # ~6 min on 2 cores
    .venv/bin/python -m benchmarks.compile_block --rounds 3 --reps 3 --seq 512
    .venv/bin/python -m benchmarks.compile_block --from-json benchmarks/results/compile_block.json

A gpt-125m layer (d 768, 12 heads, MLP 3072) at tp = 1 on a sub-batch of ``--batch``
(4) sequences of ``--seq`` (1024) tokens: the attention and MLP blocks' forward and
backward, the layer's input gradient included, fp32, every core. Modes:

``eager`` / ``compiled``
    without dropout;
``eager-drop`` / ``compiled-drop``
    dropout 0.1 in the residual and attention, drawn as eager draws it
    (``fallback_random``, what ``parallel.compile`` sets: exact masks, exact recompute);
``compiled-drop-inductor-rng``
    dropout 0.1 drawn by inductor's own generator (not what oases runs: its cost is the
    price of exactness).

Each mode runs in its own process, so that its compiled graphs are its own: ``--warmup``
steps (compiling included, timed apart as the compile time), then ``--reps`` timed
steps. Every round runs every mode once, in turn (interleaved); a mode's figure is the
median of all its timed steps. Writes ``benchmarks/results/compile_block.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.lib import driver

MODES = {"eager": (0.0, None), "compiled": (0.0, True), "eager-drop": (0.1, None),
         "compiled-drop": (0.1, True), "compiled-drop-inductor-rng": (0.1, False)}


def worker(mode: str, batch: int, seq: int, warmup: int, reps: int) -> dict:
    """One mode in this process: compile time (the warm-up steps) and step times."""
    from oases.models import build_model
    from oases.config import load_config
    from oases.parallel.compile import compile_blocks

    dropout, fallback = MODES[mode]
    cfg = load_config(None, ["model.name=gpt-125m", "model.n_layer=1", f"model.seq_len={seq}",
                             f"model.dropout={dropout}"]).validate(1)
    model = build_model(cfg.model, cfg.padded_vocab_size, seed=0).train()
    if fallback is not None:
        compile_blocks(model, strict=True)
        torch._inductor.config.fallback_random = fallback
    layer = model.layers[0]
    x = torch.randn(batch, seq, cfg.model.d_model, requires_grad=True)
    g = torch.randn(batch, seq, cfg.model.d_model)

    def step():
        t = time.perf_counter()
        layer(x).backward(g)
        return time.perf_counter() - t

    warm = sum(step() for _ in range(warmup))
    return {"mode": mode, "warmup_s": warm, "steps": [step() for _ in range(reps)]}


def measure(_, mode: str, args) -> dict:
    """``mode`` in a fresh process, so that its compiled graphs are its own."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.compile_block", "--worker", mode,
                           "--batch", str(args.batch), "--seq", str(args.seq), "--warmup",
                           str(args.warmup), "--reps", str(args.reps)],
                          capture_output=True, text=True)
    if proc.returncode:
        return {"error": (proc.stdout + proc.stderr)[-600:]}
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**rec, "step_s": statistics.median(rec["steps"])}


def summarize(runs: list[dict]) -> list[dict]:
    """Per mode: the median of all its timed steps, the speed-up against its eager twin,
    the warm-up times."""
    base = {"eager": "eager", "compiled": "eager", "eager-drop": "eager-drop",
            "compiled-drop": "eager-drop", "compiled-drop-inductor-rng": "eager-drop"}
    by_mode: dict = {}
    for r in runs:
        if r.get("ok", True):
            by_mode.setdefault(r["mode"], []).append(r)
    med = {m: statistics.median(s for run in v for s in run["steps"]) for m, v in by_mode.items()}
    return [{"mode": m, "step_s": med[m], "vs_eager": med.get(base[m], med[m]) / med[m],
             "first_round_warmup_s": v[0]["warmup_s"],
             "warmup_s": statistics.median(r["warmup_s"] for r in v)} for m, v in by_mode.items()]


def render(out: Path, data: dict) -> None:
    meta, w = data["meta"], data["meta"]["warmup"]
    lines = [*driver.report_head("# `parallel.compile`: one gpt-125m layer, forward + backward, "
                                 "CPU", meta),
             f"Batch {meta['batch']} x {meta['seq']} tokens, tp 1, fp32; {meta['rounds']} "
             f"rounds x {meta['reps']} timed steps per mode, modes interleaved, medians.", "",
             f"The {w} warm-up steps include compiling. In round 1 the graphs were compiled; "
             "later rounds (new processes) found them in inductor's on-disk cache.", "",
             f"| mode | step (s) | speed-up vs eager | {w} warm-up steps, round 1 (s) | "
             f"{w} warm-up steps, median (s) |",
             "|---|---|---|---|---|"]
    for row in data.get("rows") or summarize(data["runs"]):  # older results kept rows
        lines.append(f"| {row['mode']} | {row['step_s']:.3f} | {row['vs_eager']:.2f}x | "
                     f"{row['first_round_warmup_s']:.1f} | {row['warmup_s']:.1f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def _flags(p) -> None:
    p.add_argument("--reps", type=int, default=5, help="timed steps per mode and round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (compiling) first")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--worker", help=argparse.SUPPRESS)


SUITE = driver.Suite("compile_block", "benchmarks.compile_block", MODES, measure, render,
                     metrics=("step_s", "warmup_s"), flags=_flags, min_rounds=1)

if __name__ == "__main__":
    if "--worker" in sys.argv:
        p = argparse.ArgumentParser()
        _flags(p)
        a = p.parse_args()
        print(json.dumps(worker(a.worker, a.batch, a.seq, a.warmup, a.reps)))
    else:
        raise SystemExit(driver.run_suite(SUITE, __doc__))
