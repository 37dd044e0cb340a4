"""``parallel.sub_batches=auto``: how many sub-batches the ``oases`` engine splits each
micro-batch into, decided at start-up by measuring the candidates on the run's own
devices and groups.

A split pays where one sub-batch's collective runs while another computes. It costs,
for every extra sub-batch, each block's segments run once more (their Python, ATen
calls and kernel launches: host work that does not shrink with the rows) and every
collective issued once more (a call's fixed cost), and it makes the matmuls smaller.
Where nothing communicates (every block at degree 1), or where the host's work per
segment exceeds what the device spends on it (small micro-batches, high TP degrees,
a fast link), one sub-batch is faster; where communication dominates, two or more.
The only way to know is to time both, so that is what happens:

* no TP collective and no ring attention (cp = 1) at all: 1, without measuring;
* a plan made by the planner (``parallel.plan=auto``, or a plan file that records it)
  ran the count it priced: that count;
* a resumed run: the count its checkpoint ran (the same split gives the same curve);
* else every candidate (1, 2, and 4 under sequence parallelism, where the micro-batch
  and the plan's degrees allow) runs real training steps of a throwaway model
  (:func:`oases.runtime.build.throwaway_step`, weights drawn on the device) in
  interleaved rounds; each candidate's figure is its median step time on the slowest
  rank, and the fastest wins, unless it beats fewer sub-batches by less than
  :data:`MARGIN` (fewer launches, larger matmuls, less to go wrong).

The start-up line says what was chosen and why; the checkpoint records it.
"""

from __future__ import annotations

import statistics
from typing import Optional

import torch
import torch.distributed as dist

from oases.config import Config
from oases.errors import ConfigError
from oases.parallel.groups import ParallelContext
from oases.planner.calibrate import timed_call
from oases.planner.plan_file import batch_divisor, load_plan
from oases.errors import CheckpointError
from oases.runtime.ckpt_files import find_checkpoint, read_meta
from oases.runtime.build import throwaway_step

CANDIDATES = (1, 2, 4)
MARGIN = 0.03   # more sub-batches must be this much faster to be chosen
ROUNDS = 3      # timed steps per candidate, interleaved, after one untimed


def candidates(cfg: Config, ctx: ParallelContext, degrees: Optional[list[int]]) -> list[int]:
    """The sub-batch counts this run can take: each stage replica's micro-batch splits
    into them, and each sub-batch into the parts of its smallest block degree. Four
    only under sequence parallelism (whose staggered turns want three or more)."""
    if ctx.layout is not None:
        parts = [(cfg.pipeline_batch // (s.dp // ctx.cp),
                  batch_divisor(list(s.degrees), s.tp) if s.degrees is not None else 1)
                 for s in ctx.layout.stages]
    else:
        parts = [(cfg.train.micro_batch_size,
                  batch_divisor(degrees, ctx.tp) if degrees is not None else 1)]
    sp = cfg.parallel.sequence_parallel
    return [n for n in CANDIDATES if (n < 4 or sp)
            and all(rows % n == 0 and (rows // n) % k == 0 for rows, k in parts)]


def communicates(ctx: ParallelContext, degrees: Optional[list[int]]) -> bool:
    """Whether any block of the run (any stage) has a TP collective, or a ring attention
    exchange (context parallelism), that another sub-batch could hide."""
    if ctx.cp > 1:
        return True
    if ctx.layout is not None:
        return any(s.tp > 1 and (s.degrees is None or max(s.degrees) > 1)
                   for s in ctx.layout.stages)
    return ctx.tp > 1 and (degrees is None or max(degrees) > 1)


def resolve(cfg: Config, ctx: ParallelContext, degrees: Optional[list[int]],
            log=print) -> tuple[Config, str]:
    """``cfg`` with ``parallel.sub_batches`` an integer, and the start-up line's words
    for it. Collective when it measures (every rank calls it at the same point)."""
    p = cfg.parallel
    if p.schedule != "oases":
        return cfg, ""
    if p.sub_batches != "auto":
        return cfg, plural(p.sub_batches)
    cands = candidates(cfg, ctx, degrees)
    if not cands:  # validation let it through: the micro-batch takes no count
        raise ConfigError(f"no sub-batch count splits this run's micro-batch "
                         f"({cfg.train.micro_batch_size} sequences)")
    n, why = _known(cfg, ctx, degrees, cands)
    if n is None:
        times = measure_splits(cfg, ctx, degrees, cands, log)
        n = fastest_split(times)
        why = "measured: " + ", ".join(f"{k}: {1e3 * t:.1f} ms" for k, t in times.items()) + \
            " per step"
    return cfg.with_changes({"parallel.sub_batches": n}), f"{plural(n)} (auto, {why})"


def _known(cfg: Config, ctx: ParallelContext, degrees, cands: list[int]):
    """(count, reason) where nothing needs measuring, else (None, "")."""
    if len(cands) == 1:
        return cands[0], "the only count the micro-batch takes"
    if not communicates(ctx, degrees):
        return 1, "no TP collective to hide"
    done = _resumed(cfg)
    if done in cands:
        return done, "as the checkpoint ran"
    plan = cfg.parallel.plan
    if plan and plan != "auto":
        priced = load_plan(plan).sub_batches
        if priced in cands:
            return priced, f"as plan file {plan} was priced"
    return None, ""


def _resumed(cfg: Config) -> Optional[int]:
    """The sub-batch count of the checkpoint ``resume=auto`` continues, if it says."""
    if cfg.resume != "auto":
        return None
    try:
        path, _ = find_checkpoint(cfg.out_dir)  # the one resume takes (it says why, once)
        return None if path is None else read_meta(path).get("sub_batches")
    except CheckpointError:  # resume itself says what is wrong, in one line
        return None


def measure_splits(cfg: Config, ctx: ParallelContext, degrees, cands: list[int], log) -> dict:
    """Median step seconds per candidate on the slowest rank: a throwaway model's real
    steps, the candidates in interleaved rounds. The run's random state is left as it
    was (the throwaway draws its weights and batch)."""
    if ctx.is_main:
        log(f"parallel.sub_batches=auto: timing {', '.join(map(str, cands))} sub-batches "
            f"({ROUNDS} steps each, interleaved)", flush=True)
    forked = [ctx.device] if ctx.device.type == "cuda" else []
    times: dict[int, list[float]] = {n: [] for n in cands}
    with torch.random.fork_rng(devices=forked):
        step = throwaway_step(cfg.with_changes({"parallel.sub_batches": cands[0]}), ctx,
                              degrees, fast=True)
        try:
            for rnd in range(ROUNDS + 1):
                for n in cands:
                    step.state.engine.n = n
                    t = timed_call(step, ctx.device)
                    if rnd:  # the first round warms up (allocator, autotuning)
                        times[n].append(t)
        finally:
            step.close()
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
    med = torch.tensor([statistics.median(times[n]) for n in cands], dtype=torch.float64,
                       device=ctx.device)
    if dist.is_initialized():
        dist.all_reduce(med, op=dist.ReduceOp.MAX)  # every rank waits for the slowest
    return dict(zip(cands, med.tolist()))


def fastest_split(times: dict[int, float]) -> int:
    """The fastest count; a larger one only where it beats every smaller by MARGIN."""
    best = min(times)
    for n in sorted(times):
        if times[n] < times[best] * (1 - MARGIN):
            best = n
    return best


def plural(n: int) -> str:
    return f"{n} sub-batch{'es' if n != 1 else ''}"
