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
from benchmarks.lib.machine import machine_info

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--from-json", help="re-render the report from a result's .json")
    p.add_argument("--out", default=str(driver.RESULTS / "compile_block"))
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.batch, args.seq, args.warmup, args.reps)))
        return 0
    if args.from_json:
        return driver.rerender(Path(args.from_json), render)
    t0 = time.monotonic()
    runs: dict[str, list] = {m: [] for m in args.modes}
    for r in range(args.rounds):
        for mode in args.modes:
            proc = subprocess.run([sys.executable, "-m", "benchmarks.compile_block", "--worker",
                                   mode, "--batch", str(args.batch), "--seq", str(args.seq),
                                   "--warmup", str(args.warmup), "--reps", str(args.reps)],
                                  capture_output=True, text=True, check=True)
            runs[mode].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}/{args.rounds} {mode}: steps "
                  f"{[round(s, 3) for s in runs[mode][-1]['steps']]}", flush=True)
    meta = {"command": driver.command("benchmarks.compile_block", argv),
            "machine": machine_info(), "batch": args.batch, "seq": args.seq,
            "rounds": args.rounds, "reps": args.reps, "warmup": args.warmup,
            "elapsed_min": (time.monotonic() - t0) / 60}
    driver.save(Path(args.out), {"meta": meta, "rows": summarize(runs), "runs": runs}, render)
    return 0


def summarize(runs: dict) -> list[dict]:
    """Per mode: the median step, the speed-up against its eager twin, the warm-up times."""
    base = {"eager": "eager", "compiled": "eager", "eager-drop": "eager-drop",
            "compiled-drop": "eager-drop", "compiled-drop-inductor-rng": "eager-drop"}
    med = {m: statistics.median(s for run in v for s in run["steps"]) for m, v in runs.items()}
    rows = []
    for m in runs:
        ref = base[m] if base[m] in med else m
        rows.append({"mode": m, "step_s": med[m], "vs_eager": med[ref] / med[m],
                     "first_round_warmup_s": runs[m][0]["warmup_s"],
                     "warmup_s": statistics.median(r["warmup_s"] for r in runs[m])})
    return rows


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
    for row in data["rows"]:
        lines.append(f"| {row['mode']} | {row['step_s']:.3f} | {row['vs_eager']:.2f}x | "
                     f"{row['first_round_warmup_s']:.1f} | {row['warmup_s']:.1f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
