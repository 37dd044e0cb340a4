"""One optimizer step and one evaluation, at pp = 1 or through a pipeline."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from oases.config import Config
from oases.parallel.comm import all_reduce
from oases.parallel.groups import ParallelContext
from oases.runtime.data import TrainBatches, ValBatches
from oases.runtime.dp import GradReducer
from oases.runtime.optim import clip_grads
from oases.schedule.engines import MegatronSchedule


def autocast(cfg: Config, ctx: ParallelContext):
    if cfg.train.precision == "bf16":
        return torch.autocast(ctx.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclass
class StepStats:
    """What a step measured beyond loss and norm: the fraction of the step the ranks
    spent outside F/B compute (the pipeline bubble, mean over all ranks; 0 at pp=1)."""
    bubble: float = 0.0


def train_step(model, batches: TrainBatches, opt, reducer: GradReducer, cfg: Config,
               ctx: ParallelContext, lr: float, schedule=None, pipe=None,
               stats: Optional[StepStats] = None) -> tuple[float, float]:
    """One optimizer step over ``grad_accum`` micro-batches; returns (loss, grad_norm),
    the loss averaged over micro-batches and DP ranks.

    With ``pipe`` (a :class:`~oases.runtime.pipeline.PipelineRunner`), the micro-batches
    flow through the pipeline stages; the loss (known on the last stage) and the
    gradient norm (summed over stages) are made global, so every rank decides alike.

    A non-finite loss or gradient norm leaves the step out: no optimizer update (weights
    and Adam state untouched) and zeroed gradients; the caller sees the non-finite
    values and decides (``train.on_nonfinite``). Every rank decides alike: the norm is
    reduced over TP and identical over DP after the DP reduction, the loss is reduced
    over DP and identical over TP (the vocab-parallel loss reduces it)."""
    for g in opt.param_groups:
        g["lr"] = lr
    reducer.zero_grad()
    n = cfg.train.grad_accum
    schedule = schedule or MegatronSchedule()
    amp = lambda: autocast(cfg, ctx)  # noqa: E731
    if pipe is not None:
        micro = [batches.next_batch() for _ in range(n)]  # every rank keeps the data order
        t0 = time.perf_counter()
        loss_t, busy = pipe.step(schedule, model, micro, 1.0 / n, amp, reducer.arm)
        reducer.finish()
        norm = clip_grads(model, cfg.train.grad_clip, ctx.tp_group, ctx.stage_size, reducer,
                          ctx.dp)
        elapsed = time.perf_counter() - t0
        # one sum over the world: the last stage's loss (each of its ranks adds its
        # share) and every rank's idle fraction
        share = torch.zeros(2, dtype=torch.float64, device=ctx.device)
        if loss_t is not None:
            share[0] = float(loss_t) / ctx.stage_size
        share[1] = (1.0 - busy / elapsed) / ctx.world_size if elapsed > 0 else 0.0
        dist.all_reduce(share)
        loss = float(share[0])
        if stats is not None:
            stats.bubble = max(0.0, float(share[1]))
    else:
        total = torch.zeros((), device=ctx.device)
        for i in range(n):
            x, y = batches.next_batch()
            x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
            if i == n - 1:
                reducer.arm()  # DP all-reduce overlaps the last backward
            total += schedule.forward_backward(model, x, y, 1.0 / n, amp=amp)
        reducer.finish()
        norm = clip_grads(model, cfg.train.grad_clip, ctx.tp_group, 0, reducer, ctx.dp)
        total /= n
        if ctx.dp > 1:
            all_reduce(total, ctx.dp_group)
            total /= ctx.dp
        loss = float(total)
    if math.isfinite(loss) and math.isfinite(norm):
        opt.step()
        reducer.after_step()  # ZeRO-1/2: the updated owned ranges, all-gathered
    else:
        reducer.zero_grad()
    return loss, norm


@torch.no_grad()
def evaluate(model, val: ValBatches, cfg: Config, ctx: ParallelContext, pipe=None) -> float:
    """Mean loss over the val file's first windows, contiguous and in order (through
    the pipeline stages when ``pipe`` is given; the last stage's figure, shared)."""
    model.eval()
    s = torch.zeros(2, device=ctx.device)  # (sum of losses, batches)
    for x, y in val:
        if pipe is not None:
            out = pipe.forward_only(model, x, y, lambda: autocast(cfg, ctx))
            if out is not None:
                s[0] += out
        else:
            with autocast(cfg, ctx):
                s[0] += model(x.to(ctx.device), y.to(ctx.device)).float()
        s[1] += 1
    if pipe is not None:  # only the last stage has losses: each of its ranks adds a share
        if not ctx.is_last_stage:
            s.zero_()
        s /= ctx.stage_size
        dist.all_reduce(s)
    elif ctx.dp > 1:
        all_reduce(s, ctx.dp_group)
    model.train()
    return float(s[0] / s[1])
