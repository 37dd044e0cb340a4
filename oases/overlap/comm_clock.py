"""How much of a step's TP communication was exposed, and how much hidden.

A collective's *time* runs from its launch to its completion; its *exposed* time is
how long the compute waited for it: the span of ``work.wait()``, on the host clock
on the CPU (the engine's thread blocks there) and between CUDA events on the current
stream around the wait on CUDA (the compute stream stalls there, the host does not).
The hidden time is the rest: communication that ran while the other sub-batch (or
the weight-gradient matmul) computed.

    exposed_s    = sum of the waits on TP collectives
    total_s      = sum over TP collectives of (completion - launch)
    hidden_frac  = max(0, total_s - exposed_s) / total_s

Under ``megatron`` each forward all-reduce is waited for at once (exposed whole); the
backward's column input-gradient all-reduce hides behind the weight-gradient matmul.
Under ``oases`` each wait comes after another sub-batch's segment. Collectives over
other groups (data parallelism, ZeRO) are not counted; skipped ones
(``parallel.tp_comm_noop``) neither.

    clock = CommClock(device, tp_groups)
    with clock:               # around the steps (an observer of oases.parallel.comm)
        ...
    exposed, total, n = clock.take()
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from oases.parallel.comm import CommObserver
from oases.parallel.timing import DeviceLike, Stamp, between

_FOLD_AT = 1024  # waits kept as stamps before the ended ones are read


class CommClock(CommObserver):
    """Sums the exposed and the whole time of the collectives over ``groups`` (TP)."""

    sees_launches = False  # timed at their waits

    def __init__(self, device: DeviceLike, groups) -> None:
        self.device = device
        self.on_cuda = torch.device(device).type == "cuda"
        self._groups = {id(g) for g in groups if g is not None}
        self._lock = threading.Lock()  # CUDA backward waits run on autograd's thread
        self._waits: list[tuple[Stamp, Stamp, Stamp, list]] = []
        self._read = (0.0, 0.0, 0)  # (exposed, total, count) of the waits already read

    def times_waits(self, group) -> bool:
        return id(group) in self._groups

    def waited(self, launched: Stamp, before: Stamp, after: Stamp, done: list) -> None:
        with self._lock:
            self._waits.append((launched, before, after, done))
            if len(self._waits) > _FOLD_AT:  # a long log interval: read what has ended
                self._fold()

    def _fold(self) -> None:
        keep = []
        for w in self._waits:
            # ended: the wait and the collective (on CUDA only the wait is read: per_step)
            end = w[3][0] if w[3] else (w[2] if self.on_cuda else None)
            if end is None or not all(isinstance(e, float) or e.query() for e in (w[2], end)):
                keep.append(w)
                continue
            self._read = _add(self._read, _read(*w))
        self._waits = keep

    def take(self) -> tuple[float, float, int]:
        """(exposed seconds, total seconds, collectives) since the last take; starts
        afresh. On CUDA this waits for the events (one wait, at a log step)."""
        with self._lock:
            waits, self._waits = self._waits, []
            got, self._read = self._read, (0.0, 0.0, 0)
        for w in waits:
            got = _add(got, _read(*w))
        return got

    def per_step(self, steps: int) -> tuple[float, Optional[float]]:
        """(exposed, total) seconds per step over the last ``steps`` steps (a take). On
        CUDA the total is None: a collective's completion is an event on NCCL's stream,
        which the work handle does not expose (its future's callback runs when the
        work is enqueued, not when it ends), so only the exposed time is measured."""
        exposed, total, _ = self.take()
        if self.on_cuda:
            return exposed / max(1, steps), None
        return exposed / max(1, steps), total / max(1, steps)


def _read(launched: Optional[Stamp], before: Stamp, after: Stamp,
          done: list) -> tuple[float, float, int]:
    """(exposed, total, 1) seconds of one collective (no launch stamp, on CUDA: total 0)."""
    end = done[0] if done else after  # the completion callback has run by now
    total = 0.0 if launched is None else max(0.0, between(launched, end))
    return max(0.0, between(before, after)), total, 1


def _add(a: tuple, b: tuple) -> tuple:
    return tuple(x + y for x, y in zip(a, b))


def hidden_fraction(exposed: float, total: float):
    """The hidden share of the communication time, or None when nothing communicated."""
    if total <= 0.0:
        return None
    return min(1.0, max(0.0, (total - exposed) / total))
