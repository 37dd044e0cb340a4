"""How a forward enters a TP region: the one decision a column-parallel input makes.

Entering a TP region (a replicated input going into column-parallel compute) is an
identity in forward and an all-reduce of the input gradient in backward. *Who* runs
that all-reduce is the one thing a schedule may want to change: plain autograd runs
it inside backward (blocking, or overlapped with the weight gradient by
``ColumnParallelLinear``), while the ``oases`` engine cuts the graph there and
launches the all-reduce itself. So the entry is an object (:class:`TPRegionEntry`)
that a schedule enters around the forward it runs (:func:`entering`, or ``with
CutRecorder() as rec:``); the layers and :func:`oases.parallel.comm.copy_to_tp` ask
:func:`entered_region` and use what they get, or autograd's entry when none is
entered. Layers know nothing of schedules, and a user block built from the parallel
layers gets whatever entry the engine running it chose.

Entries are per thread: one is consulted only while a forward builds the graph, on
the thread that runs that forward and entered it; nothing reads it in backward (the
``oases`` engine recomputes on its own thread, entering a recorder again). An engine
on another thread, or autograd's device thread re-running a
``torch.utils.checkpoint`` region, never sees it.
"""

from __future__ import annotations

import threading
from typing import Optional, Protocol

import torch
import torch.nn.functional as F


class TPRegionEntry(Protocol):
    """Where a replicated input enters a TP region over ``group`` (never trivial)."""

    def copy(self, x: torch.Tensor, group) -> torch.Tensor:
        """The tensor the region computes on: ``x`` in forward; its gradient is summed
        over ``group``."""
        ...

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               group) -> torch.Tensor:
        """``F.linear(self.copy(x, group), weight, bias)``, or a fused equivalent."""
        ...


_tls = threading.local()


def _stack() -> list:
    st = getattr(_tls, "entries", None)
    if st is None:
        st = _tls.entries = []
    return st


def entered_region() -> Optional[TPRegionEntry]:
    """The innermost entry entered on this thread, or None (autograd's applies)."""
    st = _stack()
    return st[-1] if st else None


class entering:
    """``with entering(entry):`` forwards on this thread enter TP regions through
    ``entry`` within the block. Reusable: an engine enters the same one again for each
    piece of a block it runs in pieces."""

    __slots__ = ("entry",)

    def __init__(self, entry: TPRegionEntry) -> None:
        self.entry = entry

    def __enter__(self) -> TPRegionEntry:
        _stack().append(self.entry)
        return self.entry

    def __exit__(self, *exc) -> None:
        _stack().remove(self.entry)


class Cut:
    """Where a TP region was entered under a :class:`CutRecorder`: ``leaf`` replaced
    ``source`` in the forward graph; its gradient must be all-reduced over ``group``
    and then fed to ``source`` (``torch.autograd.backward(source, reduced_grad)``)."""

    __slots__ = ("source", "leaf", "group")

    def __init__(self, source: torch.Tensor, leaf: torch.Tensor, group) -> None:
        self.source, self.leaf, self.group = source, leaf, group


class CutRecorder:
    """A :class:`TPRegionEntry` that cuts the autograd graph instead of inserting the
    backward all-reduce, and records the cut, so that a schedule can run the backward
    up to the cut, launch the all-reduce of the cut's gradient itself (asynchronously)
    and continue later. The same source tensor entering several column-parallel layers
    is cut once (one all-reduce for their summed gradient). Active while entered
    (``with``), on the entering thread only."""

    def __init__(self) -> None:
        self.cuts: list[Cut] = []

    def __enter__(self) -> "CutRecorder":
        _stack().append(self)
        return self

    def __exit__(self, *exc) -> None:
        _stack().remove(self)

    def cut(self, x: torch.Tensor, group) -> torch.Tensor:
        """The tensor the TP region computes on: a view of the cut's leaf. A view, so
        that autocast never caches its low-precision copy (it caches casts of leaves
        that require grad, for the weights, until its outermost region exits, and an
        engine may hold that region for a whole run)."""
        for c in self.cuts:
            if c.source is x and c.group is group:
                return c.leaf.view_as(c.leaf)
        leaf = x.detach().requires_grad_(x.requires_grad)
        self.cuts.append(Cut(x, leaf, group))
        return leaf.view_as(leaf)

    copy = cut

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               group) -> torch.Tensor:
        return F.linear(self.cut(x, group), weight, bias)

    @classmethod
    def current(cls) -> Optional["CutRecorder"]:
        """The innermost recorder entered on this thread, or None."""
        return next((e for e in reversed(_stack()) if isinstance(e, cls)), None)


class _Gathered:
    """The :class:`TPRegionEntry` of a region whose input a schedule all-gathered along
    the sequence (sequence parallelism): that all-gather's conjugate reduce-scatters the
    input gradient, so entering the region adds nothing, neither an all-reduce nor a cut."""

    @staticmethod
    def copy(x: torch.Tensor, group) -> torch.Tensor:
        return x

    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               group) -> torch.Tensor:
        return F.linear(x, weight, bias)


GATHERED = _Gathered()
