"""Block programs: compute that waits for transfers of its own, written as a generator.

Ring attention (:mod:`oases.parallel.ring_attention`) posts the receive of the next
key/value block, attends the current one, and then needs the transfer done. Written as
a *program*, a generator, it yields an :class:`Await` at that point instead of
waiting, and whoever drives it chooses what runs meanwhile:

* :func:`finish` drives it alone: each :class:`Await` is waited at once (plain autograd,
  the ``megatron`` engine, evaluation). The transfer still hides behind the compute the
  program did between posting it and yielding.
* the ``oases`` engine (:mod:`oases.overlap.block_programs`) makes each :class:`Await`
  a yield point of the sub-batch: the other sub-batches compute while it completes.

A program keeps no thread-local context (grad mode, autocast, a TP region entry) open
across a yield: the driver enters its own around each piece. Random-number state may
stay changed across a yield (a dropout stream forked, a recompute's replayed): the
``oases`` runner keeps each sub-batch's generator states apart between its turns.

**Deferred backward.** Where the engine records (:class:`ProgramCutRecorder`), a program that
would put a backward with waits of its own into the autograd graph (the ring's) instead
returns a leaf and records a :class:`ProgramCut`: the engine runs the backward to the
leaf, then the cut's backward program (yielding at its waits), then autograd from the
cut's sources, as it does for a TP region's cut (:class:`oases.parallel.region.Cut`).
"""

from __future__ import annotations

import threading
from typing import Callable, Generator, Optional

import torch

Steps = Generator["Await", None, object]
"""A block program: yields :class:`Await`, returns its result."""


class Await:
    """Yielded by a program: it continues once ``works`` (``torch.distributed`` work
    handles it started) are complete. ``clock`` (an
    :class:`~oases.parallel.timing.IntervalTimer`, or None) times the wait: the
    transfer's exposed time."""

    __slots__ = ("works", "clock")

    def __init__(self, works: list, clock=None) -> None:
        self.works, self.clock = works, clock

    def wait(self) -> None:
        """Wait for every work (on CUDA: the current stream waits for them)."""
        t0 = self.clock.start() if self.clock is not None and self.works else None
        for w in self.works:
            w.wait()
        if t0 is not None:
            self.clock.stop(t0)


def finish(program: Steps):
    """Run ``program`` to its end, waiting at each :class:`Await`; its result."""
    try:
        req = program.send(None)
        while True:
            req.wait()
            req = program.send(None)
    except StopIteration as e:
        return e.value


def done(value):
    """A program that yields nothing and returns ``value``."""
    return value
    yield  # pragma: no cover  (makes this a generator)


class ProgramCut:
    """A backward deferred to the engine: ``leaf`` stands for the program's output in the
    forward graph; ``backward(leaf.grad)`` is a program returning the gradients of
    ``sources``, which autograd then carries on from. ``held``: tensors the cut keeps
    alive for its backward beyond autograd's saved tensors (memory meters count them)."""

    __slots__ = ("leaf", "sources", "backward", "held")

    def __init__(self, leaf: torch.Tensor, sources: tuple, backward: Callable[[torch.Tensor], Steps],
                 held: tuple = ()) -> None:
        self.leaf, self.sources, self.backward, self.held = leaf, sources, backward, held


_tls = threading.local()


def recording_cuts() -> Optional[list]:
    """The list a program records its :class:`ProgramCut` in, or None (its backward goes
    into the autograd graph)."""
    st = getattr(_tls, "cuts", None)
    return st[-1] if st else None


class ProgramCutRecorder:
    """Programs run on this thread while it is entered record their deferred backwards in ``cuts``
    (a list) instead of leaving them to autograd."""

    __slots__ = ("cuts",)

    def __init__(self, cuts: list) -> None:
        self.cuts = cuts

    def __enter__(self) -> list:
        st = getattr(_tls, "cuts", None)
        if st is None:
            st = _tls.cuts = []
        st.append(self.cuts)
        return self.cuts

    def __exit__(self, *exc) -> None:
        _tls.cuts.pop()
