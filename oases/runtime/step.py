"""One optimizer step and one evaluation, at pp = 1 or through a pipeline."""

from __future__ import annotations

import contextlib
import math
from typing import Callable, ContextManager

import torch
import torch.distributed as dist

from oases.config import Config
from oases.config.schema import BF16_PRECISIONS, resolve_precision
from oases.overlap.loss_weights import loss_tokens
from oases.parallel.batch import Batch, documents_in, documents_of
from oases.parallel.comm import all_reduce
from oases.parallel.engine import Engine
from oases.parallel.groups import ParallelContext
from oases.parallel.model_view import view_of
from oases.parallel.timing import IntervalTimer
from oases.runtime.data import TrainBatches, ValBatches
from oases.runtime.optim import clip_grads_norm
from oases.runtime.state import StepStats, TrainState

__all__ = ["StepStats", "TrainState", "amp_factory", "autocast", "evaluate", "local_step",
           "pipeline_step", "step_shares", "train_step"]


def autocast(cfg: Config, ctx: ParallelContext):
    """The run's autocast context (``train.precision``, resolved for ``ctx.device``)."""
    return amp_factory(cfg, ctx)()


_NO_AUTOCAST = contextlib.nullcontext()  # reusable


def amp_factory(cfg: Config, ctx: ParallelContext) -> Callable[[], ContextManager]:
    """What makes the run's autocast context, the precision resolved once: the engines
    enter one around every forward segment, so it is made many times a step."""
    if resolve_precision(cfg.train.precision, ctx.device.type) in BF16_PRECISIONS:
        device = ctx.device.type
        return lambda: torch.autocast(device, dtype=torch.bfloat16)
    return lambda: _NO_AUTOCAST


def step_shares(model, targets: list[torch.Tensor], ctx: ParallelContext, dp: int,
                masked: bool = True) -> tuple[list, list]:
    """Each micro-batch's share of the step's loss on this rank, and the scale its
    backward is seeded with.

    The step's loss is one mean over the targets that count in the whole global batch
    (:mod:`oases.overlap.loss_weights`): micro-batch ``i`` of this DP rank, counting
    ``n_i`` targets, has the share ``n_i / N``, ``N`` the count over every micro-batch
    and DP rank. The DP reduction sums the replicas' gradients and divides by ``dp``
    (:class:`~oases.dp.reducer.GradReducer`), so the seed is ``dp * n_i / N``; with every
    target counting that is ``1 / grad_accum``, bit for bit. ``targets``: the step's
    micro-batches' targets, on the CPU.

    ``masked`` False (the batches never hold ``IGNORE_INDEX``: token corpora) means every
    target counts, on every rank alike: ``N`` is known without asking the others, and the
    shares are floats. Else the counts are summed over DP on the device and the shares
    are 0-d tensors there: the step reads nothing back to the host for them (the engines
    and the loss take tensor scales as they take floats)."""
    if not masked:
        counts = [_full_count(model, y) for y in targets]
        total = max(sum(counts) * ctx.dp, 1)
        return [c / total for c in counts], [dp * c / total for c in counts]
    counts = torch.stack([torch.as_tensor(loss_tokens(model, y)) for y in targets])
    counts = counts.to(ctx.device, torch.float64, non_blocking=True)
    total = counts.sum()
    if ctx.dp > 1:  # every rank of a stage reads its own rows of the same global batch
        all_reduce(total, ctx.dp_group)
    shares = counts / total.clamp(min=1)  # nothing counts: loss 0, no gradient
    return list(shares.float()), list((dp * shares).float())


def _full_count(model, targets: torch.Tensor) -> int:
    """:func:`loss_tokens` of targets that all count: their number (1: the model's mean
    is not over tokens), without an ATen call."""
    return targets.numel() if view_of(model).loss_tokens is not None else 1


def train_step(state: TrainState, batches: TrainBatches, lr: float) -> tuple[float, float]:
    """One optimizer step over ``grad_accum`` micro-batches; returns (loss, grad_norm).
    The loss is one mean over the targets that count in the whole global batch (every
    micro-batch and DP rank), and the gradient is that mean's: micro-batches are
    weighed by their counted targets (:func:`step_shares`).

    With ``state.pipe`` (a :class:`~oases.pipeline.runner.PipelineRunner`), the micro-batches
    flow through the pipeline stages; the loss (known on the last stage) and the
    gradient norm (summed over stages) are made global, so every rank decides alike.

    A non-finite loss or gradient norm leaves the step out: no optimizer update (weights
    and Adam state untouched) and zeroed gradients; the caller sees the non-finite
    values and decides (``train.on_nonfinite``). Every rank decides alike: the norm is
    reduced over TP and identical over DP after the DP reduction, the loss is reduced
    over DP and identical over TP (the vocab-parallel loss reduces it). The pipeline's
    bubble goes to ``state.stats``.

    The loss and the norm are read on the host once, together: the decision to update
    needs them every step, and each read waits for the device."""
    cfg, reducer = state.cfg, state.reducer
    for g in state.opt.param_groups:
        g["lr"] = lr
    reducer.zero_grad()
    micro = [batches.next_batch() for _ in range(cfg.train.grad_accum)]  # every rank alike
    shares, seeds = step_shares(state.model, [y for _, y in micro], state.ctx, reducer.dp,
                                getattr(batches, "masked", True))
    step = local_step if state.pipe is None else pipeline_step
    loss, norm = step(state, micro, shares, seeds)
    if math.isfinite(loss) and math.isfinite(norm):
        state.opt.step()
        reducer.ownership.after_step()  # ZeRO-1/2: the updated owned ranges, all-gathered
    else:
        reducer.zero_grad()
    return loss, norm


def local_step(state: TrainState, micro: list, shares: list, seeds: list) -> tuple[float, float]:
    """Forward and backward of every micro-batch on this rank (pp = 1), the DP reduction
    overlapping the last backward; returns the global loss and the clipped gradient's
    norm, read on the host together."""
    cfg, ctx, model, reducer, engine = state.cfg, state.ctx, state.model, state.reducer, \
        state.engine
    amp = amp_factory(cfg, ctx)
    total = torch.zeros((), device=ctx.device)
    micro = [Batch(*b, documents_of(b)).to(ctx.device, non_blocking=True) for b in micro]
    if cfg.parallel.overlap_fb and engine.pairs:
        losses = paired_forward_backward(engine, model, micro, seeds, amp, reducer.arm)
    else:
        losses = []
        for i, b in enumerate(micro):
            if i == len(micro) - 1:
                reducer.arm()  # DP all-reduce overlaps the last backward
            x, y = b
            losses.append(engine.forward_backward(model, x, y, seeds[i], amp=amp, docs=b.docs))
    for share, mb_loss in zip(shares, losses):
        total += share * mb_loss
    reducer.finish()
    norm_t = clip_grads_norm(model, cfg.train.grad_clip, ctx.tp_group, 0, reducer, ctx.dp)
    if ctx.dp > 1:  # the replicas' shares add up to the global mean
        all_reduce(total, ctx.dp_group)
    loss, norm = torch.stack([total.float(), norm_t.float()]).tolist()
    return loss, norm


def pipeline_step(state: TrainState, micro: list, shares: list,
                  seeds: list) -> tuple[float, float]:
    """The micro-batches through the pipeline stages (``state.pipe``); the loss (known on
    the last stage) and the gradient norm (summed over stages) made global, so every rank
    decides alike; the pipeline's bubble goes to ``state.stats``."""
    cfg, ctx, model, reducer = state.cfg, state.ctx, state.model, state.reducer
    whole = IntervalTimer(ctx.device)  # the step on the device's timeline, as busy is
    t0 = whole.start()
    losses, busy = state.pipe.step(state.engine, model, micro, seeds, amp_factory(cfg, ctx),
                                   reducer.arm)
    reducer.finish()
    norm_t = clip_grads_norm(model, cfg.train.grad_clip, ctx.tp_group, ctx.stage_size,
                             reducer, ctx.dp)
    whole.stop(t0)
    # on CUDA reading the two timers waits for the step's work, which the loss read
    # below waits for anyway; the idle fraction then joins the loss in one sum
    elapsed, busy_s = whole.take(), busy.take()
    # one sum over the world: the last stage's loss (each replica adds its share of
    # the global mean, divided among its TP ranks, which hold the same value) and
    # every rank's idle fraction
    sums = torch.zeros(2, dtype=torch.float64, device=ctx.device)
    if losses is not None:
        sums[0] = sum(w * loss for w, loss in zip(shares, losses)).double() / ctx.tp
    sums[1] = (1.0 - busy_s / elapsed) / ctx.world_size if elapsed > 0 else 0.0
    dist.all_reduce(sums)
    loss, bubble, norm = torch.cat([sums, norm_t.double().reshape(1)]).tolist()
    state.stats.bubble = max(0.0, bubble)
    return loss, norm


def paired_forward_backward(engine: Engine, model, micro: list, seeds: list[float], amp,
                            before_last_backward) -> list[torch.Tensor]:
    """``parallel.overlap_fb`` at pp=1: F0, then each backward interleaved with the next
    micro-batch's forward (:meth:`~oases.overlap.engines.OasesEngine.backward_forward`),
    then the last backward alone (the DP reduction armed before it, as unpaired):

        F0 | B0+F1 | B1+F2 | ... | B(n-2)+F(n-1) | B(n-1)

    Returns each micro-batch's loss, as ``forward_backward`` would."""
    (x, y), rest = micro[0], micro[1:]
    run = engine.forward(model, x, y, amp, documents_of(micro[0]))
    losses = [run.loss]
    for i, b in enumerate(rest):
        x, y = b
        _, run = engine.backward_forward(run, None, seeds[i], model, x, y, amp, documents_of(b))
        losses.append(run.loss)
    before_last_backward()
    engine.backward(run, None, seeds[-1], amp)
    return losses


@torch.no_grad()
def evaluate(model, val: ValBatches, cfg: Config, ctx: ParallelContext, pipe=None) -> float:
    """Mean loss over every target of the val file's first windows, contiguous and in
    order (through the pipeline stages when ``pipe`` is given; the last stage's figure,
    shared). Each batch's mean enters weighed by its counted targets, so the padding
    rows of a partial last batch (:class:`~oases.runtime.data.ValBatches`) count for
    nothing: the result is the token mean over the windows, as in one unsharded pass."""
    model.eval()
    s = torch.zeros(2, dtype=torch.float64, device=ctx.device)  # (sum of losses, targets)
    for b in val:
        x, y = b
        n = int(loss_tokens(model, y))
        docs = documents_of(b)
        if pipe is not None:
            out = pipe.forward_only(model, x, y, amp_factory(cfg, ctx), docs)
        else:
            with autocast(cfg, ctx), documents_in(model, docs and docs.to(ctx.device)):
                out = model(x.to(ctx.device), y.to(ctx.device))
        if out is not None:  # None: a pipeline stage before the last
            s[0] += out.double() * n
            s[1] += n
    if pipe is not None:  # only the last stage adds: its TP ranks hold the same sums
        s /= ctx.tp
        dist.all_reduce(s)
    elif ctx.dp > 1:
        all_reduce(s, ctx.dp_group)
    model.train()
    return float(s[0] / s[1].clamp(min=1))
