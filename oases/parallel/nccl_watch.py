"""A hung NCCL collective ends the run within ``parallel.timeout_s`` and a few seconds.

Under ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (:mod:`oases.parallel.nccl_env`) ProcessGroupNCCL's
watchdog thread marks a group failed as soon as one of its collectives times out: its
backend's ``get_error()`` stops returning ``SUCCESS``. What it does next is slow. For that
collective, and then for every collective queued behind it, it sleeps 4 x
``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC`` (15 s by default: a minute per collective) before
aborting, holding the lock the host's next collective needs to enqueue. A rank with K
collectives in flight would raise only K minutes later, and torch's heartbeat monitor
takes the process down with SIGABRT 480 s after the flight-recorder dump, before that.
Measured on one H200 (torch 2.11, NCCL 2.28.9, a 2 s timeout and a 0.5 s dump wait): the
first collective timed out at 2 s, and the loop's next collective raised only after 28 s,
once the watchdog had slept 2 s for each of the 11 collectives queued behind it.

:class:`NcclWatch` is a daemon thread that reads each NCCL group's ``get_error()`` every
:data:`POLL_S` (a mutex read, no CUDA call). At the first failure it waits, bounded, for
this rank's flight-recorder dump to be written, prints the run's one line for a failed
collective (:class:`~oases.errors.CollectiveError`'s) and ends the process with exit status
4. It uses ``os._exit``: the process group's destructor would join the watchdog thread in
the middle of its sleeps. The thread polls outside the step: it never touches the GPU or
the step's streams.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from oases.errors import EXIT_COLLECTIVE
from oases.parallel.ranks import live_groups

POLL_S = 0.5
DUMP_WAIT_S = 10.0      # at most this long for the flight-recorder dump to appear and settle


def nccl_backends() -> list[tuple[int, object]]:
    """(index among this rank's groups, NCCL backend) for each live group that has one and
    whose backend says whether it failed (``get_error``: torch builds that lack it give
    nothing to watch)."""
    out = []
    for i, g in enumerate(live_groups()):
        try:
            b = g._get_backend(torch.device("cuda"))
        except (RuntimeError, ValueError):
            continue  # no CUDA backend (gloo)
        if hasattr(b, "get_error"):
            out.append((i, b))
    return out


def failed(backend) -> Optional[str]:
    """The error a backend reports (its ``ErrorType`` name), or None while it is well."""
    err = backend.get_error()
    name = getattr(err, "name", str(err))
    return None if name == "SUCCESS" else name


def dump_settled(path: Optional[Path], wait_s: float, poll_s: float = 0.2) -> bool:
    """Wait until the file at ``path`` exists and its size stopped changing, at most
    ``wait_s``; True if it did."""
    if path is None:
        return False
    deadline, last = time.monotonic() + wait_s, -1
    while time.monotonic() < deadline:
        size = path.stat().st_size if path.exists() else -1
        if size >= 0 and size == last:
            return True
        last = size
        time.sleep(poll_s)
    return False


class NcclWatch:
    """``backends()``: the (index, backend) pairs to watch; ``line(group, error, dumped)``:
    the one line to print; ``exit``: what ends the process (``os._exit``)."""

    def __init__(self, backends: Callable[[], Iterable[tuple[int, object]]],
                 line: Callable[[int, str, bool], str], dump: Optional[Path] = None,
                 poll_s: float = POLL_S, dump_wait_s: float = DUMP_WAIT_S,
                 exit: Callable[[int], None] = os._exit) -> None:
        self._backends, self._line, self.dump = backends, line, dump
        self._poll_s, self._dump_wait_s, self._exit = poll_s, dump_wait_s, exit
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def check(self) -> Optional[tuple[int, str]]:
        """The first failed group (its index, its error), or None."""
        for i, b in self._backends():
            err = failed(b)
            if err is not None:
                return i, err
        return None

    def start(self) -> bool:
        """Watch in a daemon thread; False (and no thread) when there is nothing to watch."""
        if not list(self._backends()):
            return False
        self._thread = threading.Thread(target=self._run, name="oases-nccl-watch", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self._poll_s)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            hit = self.check()
            if hit is None:
                continue
            dumped = dump_settled(self.dump, self._dump_wait_s)
            if self._stop.is_set():  # the run ended meanwhile: its own path reports
                return
            print(f"error: {self._line(hit[0], hit[1], dumped)}", file=sys.stderr, flush=True)
            self._exit(EXIT_COLLECTIVE)
            return


def watch_run(rank: int, timeout_s: float, environ=os.environ) -> NcclWatch:
    """The watch of a training rank, started where NCCL groups exist (stop it when the
    run ends). Its line has the shape of the trainer's for a failed collective; the dump
    it waits for is torch's file for this rank (``TORCH_FR_DUMP_TEMP_FILE`` + rank)."""
    prefix = environ.get("TORCH_FR_DUMP_TEMP_FILE", environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE"))
    dump = Path(f"{prefix}{rank}") if prefix else None

    def line(group: int, err: str, dumped: bool) -> str:
        where = f"; flight recorder: {dump}" if dumped else ""
        return (f"[rank {rank}] a collective failed or did not complete within "
                f"parallel.timeout_s={timeout_s:g}: a peer rank died or hangs (NCCL group "
                f"{group}: {err}{where})")

    w = NcclWatch(nccl_backends, line, dump)
    w.start()
    return w
