"""The calibration timer of ``parallel.plan=auto``: real training steps, timed.

The cost model's host cost of communication is fitted to these steps
(:func:`oases.planner.cost.calibrate_host_cost`); they run the real step
(:func:`oases.runtime.step.train_step`) on a throwaway model fed one random
micro-batch, so nothing of the run itself is touched.
"""

from __future__ import annotations

import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist

from oases.config import Config
from oases.parallel.groups import ParallelContext


class _FixedBatches:
    """One random micro-batch, over and over (timing only)."""

    def __init__(self, cfg: Config) -> None:
        g = torch.Generator().manual_seed(cfg.seed)
        ids = torch.randint(0, cfg.model.vocab_size,
                            (cfg.train.micro_batch_size, cfg.model.seq_len + 1), generator=g)
        self.x, self.y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def next_batch(self):
        return self.x, self.y


def time_steps(cfg: Config, ctx: ParallelContext, degrees: Optional[list[int]], steps: int,
               warmup: int = 2) -> float:
    """Median wall time of ``steps`` real training steps (after ``warmup``) with these
    per-block degrees (None: every block at tp), on a throwaway model fed one random
    micro-batch; the slowest rank's figure. Collective: every rank calls it. It draws
    random numbers: callers that must not be affected fork the random state
    (``resolve_plan`` does)."""
    from oases.runtime.build import model_for, seed_tracker, training_for
    from oases.runtime.step import train_step

    tracker = seed_tracker(cfg, ctx)
    model = model_for(cfg, ctx, tracker, degrees, cfg.seed)
    schedule, opt, reducer, pipe = training_for(cfg, ctx, model, tracker, None)
    batches = _FixedBatches(cfg)
    times = []
    for i in range(warmup + steps):
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        t0 = time.perf_counter()
        train_step(model, batches, opt, reducer, cfg, ctx, cfg.train.lr, schedule, pipe)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    del model, opt, reducer
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    res = torch.tensor([statistics.median(times)], dtype=torch.float64, device=ctx.device)
    if dist.is_initialized():
        dist.all_reduce(res, op=dist.ReduceOp.MAX)
    return float(res)
