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
import functools
import threading
from collections import Counter
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

# Cut and CutRecorder belong to this module's API: copy_to_tp defers to the entry
from oases.parallel.region import Cut, CutRecorder, entered_region  # noqa: F401
from oases.parallel.timing import Stamp, stamp

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommScope(NamedTuple):
    """What watches or suppresses collectives: the counters, observers and no-op groups
    entered on a thread. Immutable: entering one of them makes a new scope, so a scope
    can be captured and restored (:func:`current_scope`, :func:`comm_scope`).

    Scopes are per thread, not process-global: a counter entered on one thread does
    not see collectives issued by an unrelated thread (another engine, another model).
    A backward runs where autograd puts it: on the calling thread on CPU, on a device
    worker thread on CUDA, whose thread-local state is empty. So the TP functions of
    this module capture the scope when their forward builds the graph and issue their
    backward collectives under it, as ``torch.amp.custom_bwd`` does for autocast: a
    backward collective is seen by exactly the counters and observers (and skipped by
    the no-op groups) of its forward, on whichever thread and device it runs. Code
    that issues collectives from autograd hooks (gradient buckets) should capture
    :func:`current_scope` when it arms the hooks and run them under it."""

    counters: tuple = ()
    observers: tuple = ()
    noop: tuple = ()      # NoopCollectives


_EMPTY = CommScope()
_tls = threading.local()


def current_scope() -> CommScope:
    """This thread's scope (empty on a thread that entered nothing)."""
    return getattr(_tls, "scope", _EMPTY)


@contextlib.contextmanager
def comm_scope(scope: CommScope):
    """Run the block under ``scope`` (captured earlier, maybe on another thread)."""
    prev = current_scope()
    _tls.scope = scope
    try:
        yield
    finally:
        _tls.scope = prev


def backward_in_forward_scope(backward):
    """For an autograd Function whose backward issues collectives: run ``backward``
    under the scope its forward stored in ``ctx.comm_scope`` (``= current_scope()``),
    whichever thread autograd runs it on (see :class:`CommScope`)."""

    @functools.wraps(backward)
    def run(ctx, *grads):
        with comm_scope(ctx.comm_scope):
            return backward(ctx, *grads)

    return run


def _enter(field: str, item) -> None:
    cur = current_scope()
    _tls.scope = cur._replace(**{field: getattr(cur, field) + (item,)})


def _leave(field: str, item) -> None:
    cur = current_scope()
    items = list(getattr(cur, field))
    for k, x in enumerate(items):
        if x is item:
            del items[k]
            break
    _tls.scope = cur._replace(**{field: tuple(items)})


class _Watcher:
    """Entered with ``with``; acts only while open (a scope captured by a graph may
    outlive the ``with`` block: its backward is then neither seen nor skipped)."""

    _field = ""

    def __enter__(self):
        self._open = getattr(self, "_open", 0) + 1
        _enter(self._field, self)
        return self

    def __exit__(self, *exc) -> None:
        self._open -= 1
        _leave(self._field, self)

    def _is_open(self) -> bool:
        return getattr(self, "_open", 0) > 0


class CommCounter(_Watcher):
    """Counts collectives by kind while active (``with CommCounter() as c:``).

    Counters nest: every counter of the current scope (:class:`CommScope`) sees every
    collective. They count only while their ``with`` block is open, so no state
    outlives a step.
    """

    _field = "counters"

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.bytes: Counter = Counter()

    @staticmethod
    def record(kind: str, t: torch.Tensor) -> None:
        for c in current_scope().counters:
            if c._is_open():
                c.counts[kind] += 1
                c.bytes[kind] += t.numel() * t.element_size()


class CommObserver(_Watcher):
    """Base for observers of collectives: while one is entered (``with obs:``), the
    collectives of its scope (:class:`CommScope`) are reported at launch to
    ``obs.collective(name, lane, work, start)`` (when ``sees_launches``) and, over the
    groups it :meth:`times_waits` for, at each wait (:meth:`waited`)."""

    _field = "observers"
    sees_launches = True

    def collective(self, name: str, lane: str, work, start: Optional[Stamp] = None) -> None:
        """``start``: the launch, a :func:`~oases.parallel.timing.stamp` (host clock on
        the CPU, a CUDA event on CUDA)."""
        raise NotImplementedError

    def times_waits(self, group) -> bool:
        """True: the waits on this module's collectives over ``group`` are reported to
        :meth:`waited` (the exposed-communication clock)."""
        return False

    def waited(self, launched: Stamp, before: Stamp, after: Stamp, done: list) -> None:
        """A wait on a collective launched at ``launched`` ran from ``before`` to
        ``after``; ``done`` receives the collective's completion stamp (read it later)."""


class _WatchedWork:
    """A collective's work handle whose ``wait`` is stamped on the device's timeline and
    reported to the observers that time waits over its group (:meth:`CommObserver.waited`).
    On the CPU the stamps bracket the host's block; on CUDA they are events on the current
    stream around ``work.wait()``, so their distance is how long that stream stalled."""

    def __init__(self, work, observers: list, device: torch.device, launched: Stamp) -> None:
        self.work, self.observers, self.device, self.launched = work, observers, device, launched
        self.done: list = []  # the completion stamp, set by the work's future callback
        if device.type != "cuda":  # a CUDA future's callback runs at enqueue, not at the end
            work.get_future().then(lambda _f: self.done.append(stamp(device)))

    def wait(self, timeout=None) -> bool:
        before = stamp(self.device)
        ok = self.work.wait() if timeout is None else self.work.wait(timeout)
        after = stamp(self.device)
        for obs in self.observers:
            obs.waited(self.launched, before, after, self.done)
        return ok

    def __getattr__(self, name):
        return getattr(self.work, name)


def active_observers() -> list:
    """The open observers of this thread's scope."""
    return [o for o in current_scope().observers if o._is_open()]


def launch_observed(name: str, group, device: torch.device, launch: Callable[[], object]):
    """``launch()`` (which starts a collective over ``group`` and returns its work) with
    this scope's observers told: those that see launches get it with its launch stamp,
    those that time waits over ``group`` get the returned work's waits. Nothing is
    stamped when no observer wants it; on CUDA a wait timer reads only the wait (its
    launch is not stamped for it)."""
    observers = active_observers()
    seers = [o for o in observers if o.sees_launches]
    timers = [o for o in observers if o.times_waits(group)]
    if not seers and not timers:
        return launch()
    start = stamp(device) if seers or device.type != "cuda" else None  # device timeline
    work = launch()
    for obs in seers:
        obs.collective(name, "comm", work, start)
    return _WatchedWork(work, timers, device, start) if timers else work


class NoopCollectives(_Watcher):
    """Timing only: while active, collectives over ``group`` do nothing (same shapes,
    wrong values). ``with NoopCollectives(tp_group):`` gives the no-communication
    upper bound of a schedule. Scoped like a counter (:class:`CommScope`)."""

    _field = "noop"

    def __init__(self, group) -> None:
        self.group = group

    @staticmethod
    def active(group) -> bool:
        return any(n.group is group and n._is_open() for n in current_scope().noop)


class _DoneWork:
    """Stands in for the work handle of a collective that was skipped."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


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


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(t: torch.Tensor, group, async_op: bool = False, op=dist.ReduceOp.SUM):
    """In-place all-reduce of ``t`` over ``group``; returns the work handle if async.

    ``t`` must be contiguous: NCCL refuses other layouts (gloo copies them), so a
    strided tensor is refused here on every backend rather than on the GPU cluster
    only. Callers that hold a view reduce ``t.contiguous()`` and use that."""
    if not t.is_contiguous():
        raise ValueError(f"all_reduce of a non-contiguous tensor (shape {tuple(t.shape)}, "
                         f"strides {t.stride()}): reduce t.contiguous() and use the result")
    CommCounter.record("all_reduce", t)
    if NoopCollectives.active(group):
        return _DoneWork() if async_op else None
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
    CommCounter.record("all_gather", src)
    if NoopCollectives.active(group):
        return torch.cat([src] * n), _DoneWork()
    out = torch.empty((n * src.shape[0],) + tuple(src.shape[1:]), dtype=t.dtype, device=t.device)
    return out, launch_observed("all-gather", group, t.device,
                                lambda: _all_gather_single(out, src, group=group, async_op=True))


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


def _trivial(group) -> bool:
    return group is None or dist.get_world_size(group) == 1


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
    return x if _trivial(group) else (entered_region() or AUTOGRAD_ENTRY).copy(x, group)


def column_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  group) -> torch.Tensor:
    """``F.linear(copy_to_tp(x, group), weight, bias)`` through the entered
    :class:`~oases.parallel.region.TPRegionEntry` (a column-parallel layer's input)."""
    if _trivial(group):
        return F.linear(x, weight, bias)
    return (entered_region() or AUTOGRAD_ENTRY).linear(x, weight, bias, group)


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
