"""Stop cleanly on a scheduler's notice: SIGTERM or SIGUSR1 (Slurm's ``--signal``).

The handler only records the signal. After each step the loop asks
:meth:`StopSignals.agreed`, which shares the flag with every rank (a signal may reach
some ranks before others, or only one), so every rank stops after the same step, saves
the same checkpoint and exits with :class:`~oases.errors.Preempted` (status 5).

The flag travels on the host, never through the GPU, and is read a step late: each
call starts an all-reduce (MAX) of this rank's flag over a CPU (gloo) group and reads
the one the previous call started, which ended long ago. So a step pays neither a
device synchronisation nor a network round trip for it, and a rank stops one step
after the one during which the first rank got its signal.
"""

from __future__ import annotations

import signal
import threading
from typing import Optional

import torch
import torch.distributed as dist

from oases.parallel.ranks import world_timeout

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def host_group():
    """A gloo group over every rank, for flags that live on the host (collective: every
    rank calls it at the same point). None where the default group serves: a world of
    one, or a default group that is gloo already."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo", timeout=world_timeout())


class StopSignals:
    """``with StopSignals(group) as stop:`` installs the handlers (main thread only;
    elsewhere it does nothing) and restores the previous ones on exit. ``group``: a gloo
    group over every rank (None in a world of one, or to use the default group when it
    is gloo)."""

    def __init__(self, group=None) -> None:
        self.received: Optional[int] = None
        self.group = group
        self._old: dict = {}
        self._pending: Optional[tuple] = None  # (flag, work) of the last call

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

    def agreed(self) -> Optional[str]:
        """The name of a stop signal any rank had received when the previous call was
        made, or None (collective: every rank calls it after every step)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return signal.Signals(self.received).name if self.received else None
        seen = self.finish()
        flag = torch.tensor([self.received or 0], dtype=torch.int64)  # host memory
        self._pending = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group,
                                               async_op=True))
        return signal.Signals(seen).name if seen else None

    def finish(self) -> int:
        """Wait for the all-reduce the last call started (it ended a step ago) and return
        its flag (0: none). The loop calls it once more after its last step, so no
        collective is left unwaited; not on an error, where a peer may be gone."""
        if self._pending is None:
            return 0
        flag, work = self._pending
        self._pending = None
        work.wait()
        return int(flag)
