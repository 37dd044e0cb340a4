"""Autograd-aware TP communication: each op is a forward/backward conjugate pair.

    op                    forward                      backward
    copy_to_tp            identity                     all-reduce
    reduce_from_tp        all-reduce                   identity
    gather_from_tp(d)     all-gather along d           keep own chunk of d
    scatter_to_tp(d)      keep own chunk of d          all-gather along d
    reduce_scatter_to_tp  reduce-scatter along d       all-gather along d
    all_gather_to_tp      all-gather along d           reduce-scatter along d

``group=None`` or a group of size 1 makes every op an identity, so the same
model code runs unsharded. Collectives issued here go through :func:`collective`,
which a :class:`CommCounter` can observe (tests count collectives per step).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from typing import Optional

import torch
import torch.distributed as dist

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommCounter:
    """Counts collectives by kind while active (``with CommCounter() as c:``).

    Counters nest: every active counter sees every collective. They live only
    for the ``with`` block, so no state outlives a step.
    """

    _active: list["CommCounter"] = []

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.bytes: Counter = Counter()

    def __enter__(self) -> "CommCounter":
        CommCounter._active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        CommCounter._active.remove(self)

    @classmethod
    def record(cls, kind: str, t: torch.Tensor) -> None:
        for c in cls._active:
            c.counts[kind] += 1
            c.bytes[kind] += t.numel() * t.element_size()


class CommObserver:
    """Base for observers of collective lifetimes (the schedule tracer): while one is
    entered (``with obs:``), :func:`all_reduce` reports each collective to
    ``obs.collective(name, lane, work, start)``."""

    _active: list["CommObserver"] = []

    def __enter__(self):
        CommObserver._active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        CommObserver._active.remove(self)

    def collective(self, name: str, lane: str, work, start: Optional[float] = None) -> None:
        raise NotImplementedError


class NoopCollectives:
    """Timing only: while active, collectives over ``group`` do nothing (same shapes,
    wrong values). ``with NoopCollectives(tp_group):`` gives the no-communication
    upper bound of a schedule."""

    _groups: list = []

    def __init__(self, group) -> None:
        self.group = group

    def __enter__(self) -> "NoopCollectives":
        NoopCollectives._groups.append(self.group)
        return self

    def __exit__(self, *exc) -> None:
        NoopCollectives._groups.remove(self.group)

    @classmethod
    def active(cls, group) -> bool:
        return any(g is group for g in cls._groups)


class _DoneWork:
    """Stands in for the work handle of a collective that was skipped."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(t: torch.Tensor, group, async_op: bool = False, op=dist.ReduceOp.SUM):
    """In-place all-reduce of ``t`` over ``group``; returns the work handle if async."""
    CommCounter.record("all_reduce", t)
    if NoopCollectives.active(group):
        return _DoneWork() if async_op else None
    if not CommObserver._active:
        return dist.all_reduce(t, op=op, group=group, async_op=async_op)
    start = time.perf_counter()
    work = dist.all_reduce(t, op=op, group=group, async_op=True)
    for tr in CommObserver._active:
        tr.collective("all-reduce", "comm", work, start)
    if async_op:
        return work
    work.wait()
    return None


def all_gather_async(t: torch.Tensor, group) -> tuple[torch.Tensor, object]:
    """Start an all-gather along dim 0; returns (output, work). The output is valid
    after ``work.wait()``."""
    n = group_size(group)
    src = t.contiguous()
    CommCounter.record("all_gather", src)
    if NoopCollectives.active(group):
        return torch.cat([src] * n), _DoneWork()
    out = torch.empty((n * src.shape[0],) + tuple(src.shape[1:]), dtype=t.dtype, device=t.device)
    start = time.perf_counter()
    work = _all_gather_single(out, src, group=group, async_op=True)
    for obs in CommObserver._active:
        obs.collective("all-gather", "comm", work, start)
    return out, work


def _all_gather(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    n = group_size(group)
    src = t.movedim(dim, 0).contiguous()
    CommCounter.record("all_gather", src)
    if NoopCollectives.active(group):
        return torch.cat([src] * n).movedim(0, dim).contiguous()
    out = torch.empty((n * src.shape[0],) + tuple(src.shape[1:]), dtype=t.dtype, device=t.device)
    _all_gather_single(out, src, group=group)
    # rank chunks are concatenated along the moved dim; move it back
    return out.movedim(0, dim).contiguous()


def _split(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    n = group_size(group)
    if t.shape[dim] % n:
        raise ValueError(f"dim {dim} of size {t.shape[dim]} does not split over {n} ranks")
    return t.chunk(n, dim=dim)[group_rank(group)].contiguous()


def _reduce_scatter(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    n = group_size(group)
    if t.shape[dim] % n:
        raise ValueError(f"dim {dim} of size {t.shape[dim]} does not split over {n} ranks")
    src = t.movedim(dim, 0).contiguous()
    CommCounter.record("reduce_scatter", src)
    if NoopCollectives.active(group):
        return src.chunk(n)[group_rank(group)].movedim(0, dim).contiguous()
    out = torch.empty((src.shape[0] // n,) + tuple(src.shape[1:]), dtype=t.dtype, device=t.device)
    _reduce_scatter_single(out, src, group=group)
    return out.movedim(0, dim).contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        all_reduce(g, ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return _split(g, ctx.group, ctx.dim), None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.group, ctx.dim), None, None


class _ReduceScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.group, ctx.dim), None, None


class _AllGatherToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.group, ctx.dim), None, None


def _trivial(group) -> bool:
    return group is None or dist.get_world_size(group) == 1


class Cut:
    """Where a TP region was entered under a :class:`CutRecorder`: ``leaf`` replaced
    ``source`` in the forward graph; its gradient must be all-reduced over ``group``
    and then fed to ``source`` (``torch.autograd.backward(source, reduced_grad)``)."""

    __slots__ = ("source", "leaf", "group")

    def __init__(self, source: torch.Tensor, leaf: torch.Tensor, group) -> None:
        self.source, self.leaf, self.group = source, leaf, group


class CutRecorder:
    """While active, :func:`copy_to_tp` cuts the autograd graph instead of inserting
    its backward all-reduce, and records the cut, so that a schedule can run the
    backward up to the cut, launch the all-reduce of the cut's gradient itself
    (asynchronously) and continue later. The same source tensor entering several
    column-parallel layers is cut once (one all-reduce for their summed gradient)."""

    _active: list["CutRecorder"] = []

    def __init__(self) -> None:
        self.cuts: list[Cut] = []

    def __enter__(self) -> "CutRecorder":
        CutRecorder._active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        CutRecorder._active.remove(self)

    def cut(self, x: torch.Tensor, group) -> torch.Tensor:
        for c in self.cuts:
            if c.source is x and c.group is group:
                return c.leaf
        leaf = x.detach().requires_grad_(x.requires_grad)
        self.cuts.append(Cut(x, leaf, group))
        return leaf

    @classmethod
    def current(cls) -> Optional["CutRecorder"]:
        return cls._active[-1] if cls._active else None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a TP region: identity forward, all-reduce of the gradient backward."""
    if _trivial(group):
        return x
    rec = CutRecorder.current()
    if rec is not None:
        return rec.cut(x, group)
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a TP region: all-reduce partial sums forward, identity backward."""
    return x if _trivial(group) else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """All-gather shards along ``dim`` (forward); backward keeps this rank's chunk."""
    return x if _trivial(group) else _GatherFromTP.apply(x, group, dim % x.dim())


def scatter_to_tp(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Keep this rank's chunk along ``dim`` (forward); backward all-gathers."""
    return x if _trivial(group) else _ScatterToTP.apply(x, group, dim % x.dim())


def reduce_scatter_to_tp(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Sum over ranks and keep this rank's chunk along ``dim``; backward all-gathers."""
    return x if _trivial(group) else _ReduceScatterToTP.apply(x, group, dim % x.dim())


def all_gather_to_tp(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """All-gather along ``dim``; backward reduce-scatters (the conjugate of
    :func:`reduce_scatter_to_tp`, as in sequence parallelism)."""
    return x if _trivial(group) else _AllGatherToTP.apply(x, group, dim % x.dim())


@contextlib.contextmanager
def count_collectives():
    with CommCounter() as c:
        yield c
