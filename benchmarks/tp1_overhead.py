"""What the oases engine costs where it has nothing to hide: tp = 1, one process (CPU).

    .venv/bin/python -m benchmarks.tp1_overhead                 # ~2 min on a quiet 2-core machine
    .venv/bin/python -m benchmarks.tp1_overhead --rounds 5 --modes megatron+none oases+none

At tp = 1 no block has a TP collective, so the oases engine's two sub-batches have
nothing to overlap: every step it takes beyond the megatron engine's (plain
autograd over the whole micro-batch) is overhead. Each mode is a fresh run state
built the way ``train.py`` builds it (``oases.runtime.build``: model, engine,
AdamW, gradient reducer), all built before timing; then ``--rounds`` rounds each run
every mode in turn (interleaved, so machine noise hits all modes alike) for
``--steps`` real ``train_step`` calls after ``--warmup`` untimed ones. A mode's
figure is the median over rounds of each round's median step time; the ratio is
oases / megatron step time at the same recompute mode (1.00 = no overhead; the
target is <= 1.03 for ``oases+none`` vs ``megatron+none``). ``oases+none+split``
keeps two sub-batches (``whole_when_alone=False``), run in turn: the split's own cost,
which a model with dropout still pays at tp = 1 (plus its RNG swaps). One intra-op
thread, fp32, synthetic tokens, dropout 0 (the configs' default).

Writes ``benchmarks/results/tp1_overhead.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.lib import driver
from benchmarks.lib.machine import machine_info
from oases.config import load_config
from oases.overlap.engines import OasesSchedule
from oases.parallel.groups import init_distributed
from oases.runtime.build import model_for, seed_tracker, training_for
from oases.runtime.data import TrainBatches
from oases.runtime.step import train_step

MODES = ["megatron+none", "oases+none", "oases+none+split", "megatron+full", "oases+full",
         "oases+fine"]
# (numerator, denominator): oases against the megatron mode that keeps as much memory
PAIRS = [("oases+none", "megatron+none"), ("oases+none+split", "megatron+none"),
         ("oases+full", "megatron+full"), ("oases+fine", "megatron+full")]
TARGET = ("oases+none", "megatron+none", 1.03)
SHAPE = ["model.name=gpt-tiny", "model.d_model=512", "model.n_layer=4", "model.n_head=8",
         "model.n_kv_heads=8", "model.ffn_hidden=2048", "model.seq_len=128",
         "model.vocab_size=256", "model.dropout=0", "train.micro_batch_size=8",
         "train.precision=fp32", "data.kind=synthetic"]


def build(mode: str, ctx):
    sched, rc, *split = mode.split("+")
    cfg = load_config(None, SHAPE + [f"parallel.schedule={sched}", f"parallel.recompute={rc}"]
                      ).validate(1)
    tracker = seed_tracker(cfg, ctx)
    model = model_for(cfg, ctx, tracker, None, seed=cfg.seed)
    state = training_for(cfg, ctx, model, tracker)
    if split:  # what a run with dropout keeps at tp = 1: two sub-batches (run in turn)
        state.engine = OasesSchedule(ctx.tp_group, 2, rc, tracker, params=state.engine.params)
    batches = TrainBatches(cfg.data, cfg.model.seq_len, cfg.model.vocab_size,
                           cfg.train.micro_batch_size, 0, 1, cfg.seed)
    return state, batches, cfg


def timed_steps(state, batches, cfg, n: int) -> list[tuple[float, float]]:
    """(wall s, CPU s of this thread) of each of ``n`` steps. With one intra-op thread all
    of a step's compute runs on this thread, so its CPU time is the step's cost with the
    other tenants' load taken out (wall time on a shared machine is not)."""
    out = []
    for _ in range(n):
        t0, c0 = time.perf_counter(), time.thread_time()
        train_step(state, batches, cfg.train.lr)
        out.append((time.perf_counter() - t0, time.thread_time() - c0))
    return out


def render(prefix: Path, data: dict) -> None:
    meta, per = data["meta"], data["modes"]
    lines = [*driver.report_head("# The oases engine at tp = 1 (nothing to hide): overhead "
                                 "against megatron", meta),
             f"Model: {meta['shape']}. One process, one intra-op thread, fp32, AdamW, "
             f"{meta['rounds']} interleaved rounds x {meta['steps']} timed steps "
             f"(after {meta['warmup']} untimed); figure = median over rounds of the round's "
             "median step time. CPU = the main thread's CPU time (all of a step's compute "
             "with one intra-op thread): the figure that other tenants' load leaves alone; "
             "wall time is given too. `oases+none+split`: two sub-batches kept (run in "
             "turn), the split's own cost.", "",
             "| mode | CPU s/step | per round | wall s/step | per round | oases / megatron "
             "(CPU; wall) |", "|---|---|---|---|---|---|"]
    for mode, r in per.items():
        cpu = ", ".join(f"{t:.3f}" for t in r["rounds"]["cpu"])
        wall = ", ".join(f"{t:.3f}" for t in r["rounds"]["wall"])
        vs = (f"{r['ratio_cpu']:.3f}x; {r['ratio_wall']:.3f}x (vs {r['vs']})"
              if "vs" in r else "")
        lines.append(f"| {mode} | {r['cpu']:.3f} | {cpu} | {r['wall']:.3f} | {wall} | {vs} |")
    num, den, need = TARGET
    if num in per and den in per:
        ratio = per[num]["ratio_cpu"]
        lines += ["", f"Target: {num} / {den} step time <= {need:.2f}: **{ratio:.3f}x "
                      f"{'PASS' if ratio <= need else 'FAIL'}** (CPU time; per round: "
                      f"{', '.join(f'{x:.3f}' for x in per[num]['ratio_cpu_rounds'])}; wall "
                      f"time {per[num]['ratio_wall']:.3f}x)."]
    if "before" in data:
        bm, bp = data["before"]["meta"], data["before"]["modes"]
        lines += ["", f"Before (`{bm['command']}` on oases {bm['machine']['git']}, "
                      f"{bm['machine']['date']}, the same shape and rounds):", "",
                  "| mode | CPU s/step | oases / megatron (CPU; wall) |", "|---|---|---|"]
        for mode, r in bp.items():
            vs = (f"{r['ratio_cpu']:.3f}x; {r['ratio_wall']:.3f}x (vs {r['vs']})"
                  if "vs" in r else "")
            lines.append(f"| {mode} | {r['cpu']:.3f} | {vs} |")
    lines += ["", "Raw numbers: `tp1_overhead.json`."]
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default=str(driver.RESULTS / "tp1_overhead"))
    ap.add_argument("--before", help="this benchmark's JSON from another tree (the one before "
                    "a change): its figures are kept in the report, side by side")
    args = ap.parse_args(argv)
    if args.rounds < 3:
        ap.error("--rounds must be >= 3 (medians of >= 3 interleaved rounds)")
    torch.set_num_threads(1)
    t_start = time.monotonic()
    ctx = init_distributed(1, "cpu")
    built = {m: build(m, ctx) for m in args.modes}
    for m in args.modes:
        timed_steps(*built[m], args.warmup)
    rounds: dict[str, dict[str, list[float]]] = {m: {"cpu": [], "wall": []} for m in args.modes}
    for rnd in range(args.rounds):
        for m in args.modes:
            steps = timed_steps(*built[m], args.steps)
            rounds[m]["wall"].append(statistics.median(w for w, _ in steps))
            rounds[m]["cpu"].append(statistics.median(c for _, c in steps))
            print(f"round {rnd} {m:14s} {rounds[m]['cpu'][-1]:.3f} s/step CPU, "
                  f"{rounds[m]['wall'][-1]:.3f} s wall", flush=True)
    per = {m: {k: statistics.median(v[k]) for k in ("cpu", "wall")} | {"rounds": v}
           for m, v in rounds.items()}
    for num, den in PAIRS:
        if num in per and den in per:
            per[num]["vs"] = den
            for k in ("cpu", "wall"):
                per[num][f"ratio_{k}"] = per[num][k] / per[den][k]
                per[num][f"ratio_{k}_rounds"] = [a / b for a, b in
                                                 zip(rounds[num][k], rounds[den][k])]
    shape = ", ".join(s.split(".", 1)[1] for s in SHAPE if s.startswith(("model.", "train.")))
    meta = {"machine": machine_info(), "command": driver.command("benchmarks.tp1_overhead", argv),
            "elapsed_min": (time.monotonic() - t_start) / 60, "rounds": args.rounds,
            "steps": args.steps, "warmup": args.warmup, "shape": shape, "threads": 1}
    data = {"meta": meta, "modes": per}
    if args.before:
        data["before"] = json.loads(Path(args.before).read_text())
    prefix = Path(args.out)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(data, indent=1))
    render(prefix, data)
    print(prefix.with_suffix(".md").read_text())
    os._exit(0)  # skip the slow process-group teardown


if __name__ == "__main__":
    raise SystemExit(main())
