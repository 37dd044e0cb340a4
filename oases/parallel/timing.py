"""Time device work where it runs, and read the figures only when they are asked for.

On CUDA a host clock around an asynchronous call times its launch, not its work
(kernels and NCCL collectives are queued and return at once). A *stamp* there is a
CUDA event recorded on the current stream, and the time between two stamps comes
from the device (``Event.elapsed_time``) when a figure is read: timing the
intervals of a step costs no synchronisation inside the step, only one wait when
the step's figures are read (at a log step). On the CPU a stamp is the host clock.

    timer = IntervalTimer(device)
    t0 = timer.start()
    ...                      # device work, queued
    timer.stop(t0)           # or: with timer.measure(): ...
    timer.take()             # seconds of every interval since the last take

:func:`label` names a range for ``torch.profiler`` traces (free when no profiler runs).
"""

from __future__ import annotations

import contextlib
import time
from typing import Optional, Union

import torch

Stamp = Union[float, torch.cuda.Event]
DeviceLike = Optional[Union[torch.device, str]]

# spans kept as stamps before the ended ones are read (a long log interval with many
# timed blocks would otherwise hold thousands of CUDA events)
_FOLD_AT = 256


# the prefix of the pipeline runner's labels (its actions and transfer waits), which the
# trace view (oases.overlap.trace) puts in a lane of their own
PIPELINE_LABEL = "pp "


def profiling() -> bool:
    """Whether a ``torch.profiler`` records now."""
    return torch.autograd.profiler._is_profiler_enabled


_NO_RANGE = contextlib.nullcontext()  # reusable: entered and left as often as wanted


def label(name: str):
    """A ``record_function`` range called ``name`` while a ``torch.profiler`` records,
    else a no-op (the engines label every sub-batch segment, launch and wait)."""
    if profiling():
        return torch.autograd.profiler.record_function(name)
    return _NO_RANGE


def on_cuda(device: DeviceLike) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def stamp(device: DeviceLike = None) -> Stamp:
    """Now, on ``device``'s timeline: a CUDA event recorded on the current stream (it
    completes when the stream reaches it), or the host clock elsewhere."""
    if on_cuda(device):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(device))
        return ev
    return time.perf_counter()


def between(a: Stamp, b: Stamp) -> float:
    """Seconds from stamp ``a`` to stamp ``b`` (on CUDA this waits until both happened)."""
    if isinstance(a, float) and isinstance(b, float):
        return b - a
    if isinstance(a, float) or isinstance(b, float):
        raise TypeError("a host time and a device event are on different clocks")
    a.synchronize()
    b.synchronize()
    return a.elapsed_time(b) / 1e3


class IntervalTimer:
    """A sum of intervals on one device's timeline (``device`` None: the host clock).

    Intervals may come from several threads (autograd's device thread runs hooks): each
    :meth:`start` returns its own stamp, and :meth:`stop` takes it back."""

    def __init__(self, device: DeviceLike = None) -> None:
        self.device = device
        self._spans: list[tuple[Stamp, Stamp]] = []
        self._read: list[float] = []  # seconds of spans already read, oldest first

    def start(self) -> Stamp:
        return stamp(self.device)

    def stop(self, started: Stamp) -> None:
        self._spans.append((started, stamp(self.device)))
        if len(self._spans) > _FOLD_AT:
            self._fold()

    @contextlib.contextmanager
    def measure(self):
        t0 = self.start()
        try:
            yield
        finally:
            self.stop(t0)

    def _fold(self) -> None:
        """Read the intervals that have ended, without waiting for the others."""
        n = 0
        for a, b in self._spans:
            if not (isinstance(b, float) or b.query()):
                break
            self._read.append(between(a, b))
            n += 1
        del self._spans[:n]

    def take_each(self) -> list[float]:
        """The seconds of each interval since the last take, in order of stopping;
        starts afresh."""
        spans, self._spans = self._spans, []
        read, self._read = self._read, []
        return read + [between(a, b) for a, b in spans]

    def take(self) -> float:
        """Seconds of every interval since the last take; starts afresh."""
        return sum(self.take_each())

    def seconds(self) -> float:
        """Seconds of every interval so far, without starting afresh."""
        return sum(self._read) + sum(between(a, b) for a, b in self._spans)
