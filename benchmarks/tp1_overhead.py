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

import contextlib
import json
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.lib import driver
from oases.config import load_config
from oases.overlap.engines import OasesEngine
from oases.parallel.groups import init_distributed
from oases.runtime.build import build_rank_model, seed_tracker, build_train_state
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
    model = build_rank_model(cfg, ctx, tracker, None, seed=cfg.seed)
    state = build_train_state(cfg, ctx, model, tracker)
    if split:  # what a run with dropout keeps at tp = 1: two sub-batches (run in turn)
        state.engine = OasesEngine(ctx.tp_group, 2, rc, tracker, params=state.engine.params)
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


def prepare(args) -> dict:
    """Every mode's run state, built before any timing, and its untimed warm-up steps."""
    torch.set_num_threads(1)
    ctx = init_distributed(1, "cpu")
    built = {m: build(m, ctx) for m in args.modes}
    for m in args.modes:
        timed_steps(*built[m], args.warmup)
    return built


def measure(built: dict, mode: str, args) -> dict:
    steps = timed_steps(*built[mode], args.steps)
    return {"wall": statistics.median(w for w, _ in steps),
            "cpu": statistics.median(c for _, c in steps)}


def _vs(r: dict) -> str:
    return f"{r['ratio_cpu']:.3f}x; {r['ratio_wall']:.3f}x (vs {r['vs']})" if "vs" in r else ""


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
        lines.append(f"| {mode} | {r['cpu']:.3f} | {cpu} | {r['wall']:.3f} | {wall} | "
                     f"{_vs(r)} |")
    num, den, need = TARGET
    if "ratio_cpu" in per.get(num, {}):
        ratio = per[num]["ratio_cpu"]
        lines += ["", f"Target: {num} / {den} step time <= {need:.2f}: **{ratio:.3f}x "
                      f"{'PASS' if ratio <= need else 'FAIL'}** (CPU time; per round: "
                      f"{', '.join(f'{x:.3f}' for x in per[num]['ratio_cpu_rounds'])}; wall "
                      f"time {per[num]['ratio_wall']:.3f}x)."]
    before = data.get("before") or meta.get("before")  # older results kept it at the top
    if before:
        bm, bp = before["meta"], before["modes"]
        lines += ["", f"Before (`{bm['command']}` on oases {bm['machine']['git']}, "
                      f"{bm['machine']['date']}, the same shape and rounds):", "",
                  "| mode | CPU s/step | oases / megatron (CPU; wall) |", "|---|---|---|"]
        lines += [f"| {mode} | {r['cpu']:.3f} | {_vs(r)} |" for mode, r in bp.items()]
    lines += ["", "Raw numbers: `tp1_overhead.json`."]
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")


def _flags(p) -> None:
    p.add_argument("--steps", type=int, default=4, help="timed steps per mode and round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per mode, once")
    p.add_argument("--before", help="this benchmark's JSON from another tree (the one before "
                   "a change): its figures are kept in the report, side by side")


SUITE = driver.Suite(
    "tp1_overhead", "benchmarks.tp1_overhead", dict.fromkeys(MODES), measure, render,
    metrics=("cpu", "wall"), pairs=tuple(PAIRS), flags=_flags,
    setup=lambda args: contextlib.nullcontext(prepare(args)),
    meta=lambda args, built: {"threads": 1, "before": (
        json.loads(Path(args.before).read_text()) if args.before else None),
        "shape": ", ".join(s.split(".", 1)[1] for s in SHAPE
                           if s.startswith(("model.", "train.")))})


if __name__ == "__main__":
    rc = driver.run_suite(SUITE, __doc__)
    os._exit(rc)  # skip the slow process-group teardown
