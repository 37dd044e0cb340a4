"""Weight gradients deferred from a backward to a later action: zero-bubble pipelines.

A zero-bubble schedule (``parallel.pp_schedule=zb-h1``; Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024) splits a stage's backward of micro-batch m in two:

    B(m)  the input gradients, with every TP collective they need (the previous stage
          waits for them: the critical path)
    W(m)  the weight gradients of the blocks' linear layers, dW = dY^T X: no
          collective, nothing waits for them, so the schedule puts them in the bubble

A :class:`WeightGradStore` is what joins the two. The parallel linear layers of a model
built with one (``Parallelism.defer_weight_grads``) compute through
:meth:`WeightGradStore.linear`; while a B runs inside :meth:`WeightGradStore.deferring`
their backward returns the input (and bias) gradient and records (weight, X, dY)
instead of computing dW; :meth:`WeightGradStore.apply` is the W: it computes each
weight's dW (summed over the records of one weight: sub-batches, recompute) and
accumulates it through autograd (``torch.autograd.backward`` on the weights), so the
weights' post-accumulate hooks fire as in any backward, once per weight and only
there: the DP reducer launches a bucket when its W's are done. Such a model's every
backward with gradients is a B (a backward outside ``deferring`` is an error: its dW
would be lost); evaluation and generation run without gradients, through ``F.linear``.

The record keeps X and dY alive from B to W: memory a zero-bubble schedule bounds by
how many W's it lets wait (ZB-H1: no more than 1F1B's in-flight activations).
Autograd may run a backward on another thread (CUDA's device threads): the store is
one object, read there, and a B and its backward run one at a time.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.nn.functional as F


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


class _DeferrableLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` in the compute dtype (autocast is active in forward,
    not in backward) whose dW goes to ``store``'s records. The weight enters detached:
    the graph has no edge to it, so nothing is accumulated into it, nor any of its hooks
    run, before W accumulates dW."""

    @staticmethod
    def forward(ctx, x, detached, bias, store, weight_ref):
        dt = _compute_dtype(x)
        xc, wc = x.to(dt), detached.to(dt)
        ctx.save_for_backward(xc, wc)
        # the parameter in a list: a tensor argument would give the graph an edge to it
        ctx.store, ctx.has_bias, (ctx.weight,) = store, bias is not None, weight_ref
        return F.linear(xc, wc, None if bias is None else bias.to(dt))

    @staticmethod
    def backward(ctx, g):
        xc, wc = ctx.saved_tensors
        pending = ctx.store.pending
        if pending is None:
            raise RuntimeError(
                "a model built to defer its weight gradients (Parallelism("
                "defer_weight_grads=True): a zero-bubble pipeline) ran a backward outside "
                "WeightGradStore.deferring(): its linear layers' dW would be lost")
        g2 = g.reshape(-1, g.shape[-1])
        pending.append((ctx.weight, xc, g2))
        db = g2.sum(0).to(ctx.weight.dtype) if ctx.has_bias else None
        return g.matmul(wc), None, db, None, None


class WeightGradStore:
    """The records one B defers to its W (see the module docstring)."""

    def __init__(self) -> None:
        self.pending: Optional[list] = None  # the list a deferring B appends to

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` whose weight gradient may be deferred."""
        if not torch.is_grad_enabled() or not weight.requires_grad:
            return F.linear(x, weight, bias)
        return _DeferrableLinear.apply(x, weight.detach(), bias, self, [weight])

    @contextlib.contextmanager
    def deferring(self) -> Iterator[list]:
        """The backward run inside defers its linear layers' dW to the list yielded (the
        W of that backward: :meth:`apply`)."""
        if self.pending is not None:
            raise RuntimeError("a backward is already deferring its weight gradients")
        records: list = []
        self.pending = records
        try:
            yield records
        finally:
            self.pending = None

    @staticmethod
    def apply(records: list) -> int:
        """The W: each weight's dW from its records, accumulated into ``weight.grad``
        through autograd (its hooks fire once per weight); returns the weights done."""
        if not records:
            return 0
        order: list = []
        dws: dict = {}
        for w, xc, g2 in records:
            dw = g2.t().matmul(xc.reshape(-1, xc.shape[-1]))
            k = id(w)
            if k in dws:
                dws[k] = dws[k] + dw
            else:
                order.append(w)
                dws[k] = dw
        records.clear()  # X and dY go now
        torch.autograd.backward(order, [dws[id(w)].to(w.dtype) for w in order])
        return len(order)
