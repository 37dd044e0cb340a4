"""Stop cleanly on a scheduler's notice: SIGTERM or SIGUSR1 (Slurm's ``--signal``).

The handler only records the signal; the loop asks :meth:`StopSignals.agreed` after
each step, which all-reduces the flag over the world (a signal may reach some ranks
before others, or only one), so every rank stops after the same step, saves the
same checkpoint and exits with :class:`~oases.errors.Preempted` (status 5).
"""

from __future__ import annotations

import signal
import threading
from typing import Optional

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """``with StopSignals() as stop:`` installs the handlers (main thread only; elsewhere
    it does nothing) and restores the previous ones on exit."""

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self._old: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def agreed(self, device: torch.device) -> Optional[str]:
        """The name of a stop signal received by any rank, or None (collective)."""
        flag = torch.tensor([self.received or 0], dtype=torch.int64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return signal.Signals(int(flag)).name if int(flag) else None
