"""Autograd-aware TP communication: each op is a forward/backward conjugate pair.

    op                    forward                      backward
    copy_to_tp            identity                     all-reduce
    reduce_from_tp        all-reduce                   identity
    gather_from_tp(d)     all-gather along d           keep own chunk of d
    scatter_to_tp(d)      keep own chunk of d          all-gather along d
    reduce_scatter_to_tp  reduce-scatter along d       all-gather along d
    all_gather_to_tp      all-gather along d           reduce-scatter along d

``group=None`` or a group of size 1 makes every op an identity, so the same
model code runs unsharded. Collectives issued here can be counted
(:class:`CommCounter`, tests count collectives per step), observed
(:class:`CommObserver`, the exposed-communication clock) or skipped
(:class:`NoopCollectives`); what is active is per thread and travels with the autograd
graph into backward (:class:`CommScope`). No mutable state here is process-global.

Who all-reduces the gradient of a TP region's input (:func:`copy_to_tp`,
:func:`column_linear`) is up to the entry a schedule entered
(:mod:`oases.parallel.region`); by default autograd's backward does.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from oases.parallel.comm_scope import (CommCounter, CommObserver, CommScope, NoopCollectives,
                                       DoneWork, active_observers, backward_in_forward_scope,
                                       comm_scope, current_scope, launch_observed)
from oases.parallel.region import Cut, CutRecorder, entered_region

# the scope machinery (oases.parallel.comm_scope) and the region entries
# (oases.parallel.region) belong to this module's API: callers count, observe and skip
# collectives, and cut graphs, through it
__all__ = ["CommCounter", "CommObserver", "CommScope", "Cut", "CutRecorder", "NoopCollectives",
           "active_observers", "all_gather_async", "all_gather_to_tp", "all_reduce",
           "column_linear", "comm_scope", "copy_to_tp", "count_collectives", "current_scope",
           "gather_from_tp", "group_rank", "group_size", "launch_observed", "reduce_from_tp",
           "reduce_scatter_async", "reduce_scatter_to_tp", "require_default_stream",
           "scatter_to_tp", "trivial"]

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def require_default_stream(device: torch.device, who: str) -> None:
    """Refuse a side CUDA stream: ``who`` orders its collectives with ``work.wait()``,
    which makes only the *current* stream wait, and frees or reuses the buffers they
    read as soon as that stream is past them. Both are correct while every kernel of
    the step runs on the device's default stream, and neither once some do not."""
    if device.type != "cuda":
        return
    cur, default = torch.cuda.current_stream(device), torch.cuda.default_stream(device)
    if cur != default:
        raise RuntimeError(f"{who} runs on the default CUDA stream only (current: {cur}, "
                           f"default: {default}): work.wait() orders the current stream "
                           f"alone, and buffers freed after a wait are reused on the stream "
                           f"that allocated them while another stream may still read them")


# A group's size, asked at every collective (is it trivial?) and by every layer: read once
# per group (dist.get_world_size validates its argument each call). Weak keys: a group
# destroyed and collected leaves the cache.
_sizes: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    if group is None:
        return 1
    n = _sizes.get(group)
    if n is None:
        n = _sizes[group] = dist.get_world_size(group)
    return n


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(t: torch.Tensor, group, async_op: bool = False, op=dist.ReduceOp.SUM):
    """In-place all-reduce of ``t`` over ``group``; returns the work handle if async.

    ``t`` must be contiguous: NCCL refuses other layouts (gloo copies them), so a
    strided tensor is refused here on every backend rather than on the GPU cluster
    only. Callers that hold a view reduce ``t.contiguous()`` and use that. A group of
    one rank, or None (what :func:`oases.parallel.ranks.new_group` gives for one rank),
    is an identity, as for every function of this module: nothing is issued (torch would
    take None for the whole world; pass ``dist.group.WORLD`` for that)."""
    if not t.is_contiguous():
        raise ValueError(f"all_reduce of a non-contiguous tensor (shape {tuple(t.shape)}, "
                         f"strides {t.stride()}): reduce t.contiguous() and use the result")
    if trivial(group):
        return DoneWork() if async_op else None
    CommCounter.record("all_reduce", t)
    if NoopCollectives.active(group):
        return DoneWork() if async_op else None
    work = launch_observed("all-reduce", group, t.device,
                           lambda: dist.all_reduce(t, op=op, group=group, async_op=True))
    if async_op:
        return work
    work.wait()
    return None


def all_gather_async(t: torch.Tensor, group) -> tuple[torch.Tensor, object]:
    """Start an all-gather along dim 0; returns (output, work). The output is valid
    after ``work.wait()``."""
    n = group_size(group)
    src = t.contiguous()
    if trivial(group):  # one rank: the gathered tensor is this rank's (see all_reduce)
        return src, DoneWork()
    CommCounter.record("all_gather", src)
    if NoopCollectives.active(group):
        return torch.cat([src] * n), DoneWork()
    out = torch.empty((n * src.shape[0],) + tuple(src.shape[1:]), dtype=t.dtype, device=t.device)
    return out, launch_observed("all-gather", group, t.device,
                                lambda: _all_gather_single(out, src, group=group, async_op=True))


class _SumChunks:
    """The work of a reduce-scatter made of an all-to-all: ``wait`` waits for it, then
    sums the chunks this rank received into ``out``."""

    def __init__(self, work, recv: torch.Tensor, out: torch.Tensor, n: int) -> None:
        self.work, self.recv, self.out, self.n = work, recv, out, n

    def wait(self, timeout=None) -> bool:
        ok = self.work.wait() if timeout is None else self.work.wait(timeout)
        torch.sum(self.recv.view(self.n, *self.out.shape), 0, out=self.out)
        return ok

    def __getattr__(self, name):
        return getattr(self.work, name)


def _reduce_scatter_into(out: torch.Tensor, src: torch.Tensor, group, n: int):
    """Start the reduce-scatter of ``src`` (dim 0) into ``out``; returns its work. gloo's
    own reduce-scatter takes as long as an all-reduce of the whole tensor (twice a
    bandwidth-optimal one's bytes, benchmarks/results/collectives.md), so on gloo it is an
    all-to-all of the chunks, (n-1)/n of the tensor each way, and a local sum."""
    if dist.get_backend(group) != "gloo":
        return _reduce_scatter_single(out, src, group=group, async_op=True)
    recv = torch.empty_like(src)
    return _SumChunks(dist.all_to_all_single(recv, src, group=group, async_op=True), recv, out, n)


def reduce_scatter_async(t: torch.Tensor, group) -> tuple[torch.Tensor, object]:
    """Start a reduce-scatter (sum) along dim 0; returns (this rank's chunk, work). The
    chunk is valid after ``work.wait()``."""
    n = _ranks_split(t, group, 0)
    src = t.contiguous()
    if trivial(group):  # one rank: its chunk is the whole sum (see all_reduce)
        return src, DoneWork()
    CommCounter.record("reduce_scatter", src)
    if NoopCollectives.active(group):
        return src.chunk(n)[group_rank(group)].clone(), DoneWork()
    out = torch.empty((src.shape[0] // n,) + tuple(src.shape[1:]), dtype=t.dtype, device=t.device)
    return out, launch_observed("reduce-scatter", group, t.device,
                                lambda: _reduce_scatter_into(out, src, group, n))


def _all_gather(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    """:func:`all_gather_async` along ``dim`` (moved first), waited for."""
    out, work = all_gather_async(t.movedim(dim, 0), group)
    work.wait()
    return out.movedim(0, dim).contiguous()  # rank chunks concatenated along dim


def _ranks_split(t: torch.Tensor, group, dim: int) -> int:
    """The group's size, which must divide ``t`` along ``dim``."""
    n = group_size(group)
    if t.shape[dim] % n:
        raise ValueError(f"dim {dim} of size {t.shape[dim]} does not split over {n} ranks")
    return n


def _split(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    return t.chunk(_ranks_split(t, group, dim), dim=dim)[group_rank(group)].contiguous()


def _reduce_scatter(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    """:func:`reduce_scatter_async` along ``dim`` (moved first), waited for."""
    out, work = reduce_scatter_async(t.movedim(dim, 0), group)
    work.wait()
    return out.movedim(0, dim).contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.comm_scope = group, current_scope()
        return x

    @staticmethod
    @backward_in_forward_scope
    def backward(ctx, g):
        g = g.contiguous().clone()
        all_reduce(g, ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    # no comm scope to capture: the backward issues no collective (a recomputed
    # forward runs in its forward's scope, oases.parallel.recompute)
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def _conjugate_pair(name: str, forward_op, backward_op, scoped: bool = True):
    """An autograd.Function that runs ``forward_op(x, group, dim)`` forward and its
    conjugate ``backward_op(g, group, dim)`` backward. ``scoped``: the backward's
    collective is issued in the comm scope its forward ran in (the backward may run on
    autograd's thread, where the scope is not set)."""

    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        if scoped:
            ctx.comm_scope = current_scope()
        return forward_op(x, group, dim)

    def backward(ctx, g):
        return backward_op(g, ctx.group, ctx.dim), None, None

    if scoped:
        backward = backward_in_forward_scope(backward)
    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


# the conjugate pairs: forward op, its backward (_split takes the local slice, no comm)
_GatherFromTP = _conjugate_pair("_GatherFromTP", _all_gather, _split, scoped=False)
_ScatterToTP = _conjugate_pair("_ScatterToTP", _split, _all_gather)
_ReduceScatterToTP = _conjugate_pair("_ReduceScatterToTP", _reduce_scatter, _all_gather)
_AllGatherToTP = _conjugate_pair("_AllGatherToTP", _all_gather, _reduce_scatter)


def trivial(group) -> bool:
    """A group over one rank (or none): its collectives are identities."""
    return group is None or group_size(group) == 1


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


class _LinearAsyncGradAllReduce(torch.autograd.Function):
    """``F.linear`` on a replicated input whose input gradient is all-reduced over TP,
    overlapped with the weight-gradient matmul (as Megatron-LM does):

        backward:  dX = dY W  -> launch all-reduce(dX)  -> dW = dY^T X, db  -> wait

    The wait happens on the stream that returns dX to autograd (the current one);
    on CUDA, NCCL's stream already waited for dX's producer at launch.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        dt = _compute_dtype(x)  # autocast is active in forward, not in backward
        xc, wc = x.to(dt), weight.to(dt)
        ctx.save_for_backward(xc, wc)
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.w_dtype = weight.dtype
        ctx.comm_scope = current_scope()  # autograd may run the backward on another thread
        return F.linear(xc, wc, None if bias is None else bias.to(dt))

    @staticmethod
    @backward_in_forward_scope
    def backward(ctx, g):
        xc, wc = ctx.saved_tensors
        g = g.contiguous()
        dx = g.matmul(wc)
        work = all_reduce(dx, ctx.group, async_op=True)
        g2 = g.reshape(-1, g.shape[-1])
        dw = g2.t().matmul(xc.reshape(-1, xc.shape[-1])).to(ctx.w_dtype)
        db = g2.sum(0).to(ctx.w_dtype) if ctx.has_bias else None
        work.wait()
        return dx, dw, db, None


class _AutogradEntry:
    """The :class:`~oases.parallel.region.TPRegionEntry` when no schedule entered one:
    the input gradient's all-reduce runs inside autograd's backward."""

    @staticmethod
    def copy(x: torch.Tensor, group) -> torch.Tensor:
        return _CopyToTP.apply(x, group)

    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               group) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return _LinearAsyncGradAllReduce.apply(x, weight, bias, group)
        return F.linear(_CopyToTP.apply(x, group), weight, bias)


AUTOGRAD_ENTRY = _AutogradEntry()


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a TP region: identity forward, all-reduce of the gradient backward."""
    return x if trivial(group) else (entered_region() or AUTOGRAD_ENTRY).copy(x, group)


def column_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  group) -> torch.Tensor:
    """``F.linear(copy_to_tp(x, group), weight, bias)`` through the entered
    :class:`~oases.parallel.region.TPRegionEntry` (a column-parallel layer's input)."""
    if trivial(group):
        return F.linear(x, weight, bias)
    return (entered_region() or AUTOGRAD_ENTRY).linear(x, weight, bias, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a TP region: all-reduce partial sums forward, identity backward."""
    return x if trivial(group) else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """All-gather shards along ``dim`` (forward); backward keeps this rank's chunk."""
    return x if trivial(group) else _GatherFromTP.apply(x, group, dim % x.dim())


def scatter_to_tp(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Keep this rank's chunk along ``dim`` (forward); backward all-gathers."""
    return x if trivial(group) else _ScatterToTP.apply(x, group, dim % x.dim())


def reduce_scatter_to_tp(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Sum over ranks and keep this rank's chunk along ``dim``; backward all-gathers."""
    return x if trivial(group) else _ReduceScatterToTP.apply(x, group, dim % x.dim())


def all_gather_to_tp(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """All-gather along ``dim``; backward reduce-scatters (the conjugate of
    :func:`reduce_scatter_to_tp`, as in sequence parallelism)."""
    return x if trivial(group) else _AllGatherToTP.apply(x, group, dim % x.dim())


@contextlib.contextmanager
def count_collectives():
    with CommCounter() as c:
        yield c
