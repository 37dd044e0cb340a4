"""What watches or suppresses TP collectives, per thread: counters (:class:`CommCounter`),
observers (:class:`CommObserver`, the exposed-communication clock) and no-op groups
(:class:`NoopCollectives`), held in an immutable :class:`CommScope` that travels with
the autograd graph into backward. :mod:`oases.parallel.comm` issues the collectives and
reports them here."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import Counter
from typing import Callable, NamedTuple, Optional

import torch

from oases.parallel.timing import Stamp, stamp


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
            try:
                future = work.get_future()
            except RuntimeError:  # gloo's reduce-scatter work has none: the wait's end
                future = None    # then stands for the completion (comm_clock)
            if future is not None:
                future.then(lambda _f: self.done.append(stamp(device)))

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


class DoneWork:
    """Stands in for the work handle of a collective that was skipped."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True
