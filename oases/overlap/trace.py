"""A per-rank event trace: compute spans and collective lifetimes, as Chrome trace JSON.

Compute spans are timed on the host around each schedule segment. A collective
is recorded from its launch to its completion, taken from the work's future
callback (which fires on the communication thread when the collective ends), so
the trace shows exactly which collectives ran while which compute did.
On CUDA the host times only bound the device work; use the PyTorch profiler there.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

from oases.parallel.comm import CommObserver


class Tracer(CommObserver):
    """``with tracer:`` also records the collectives issued through
    :func:`oases.parallel.comm.all_reduce` (e.g. inside autograd under ``megatron``)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.t0 = time.perf_counter()
        self.events: list[dict] = []
        self._lock = threading.Lock()

    def _us(self, t: float) -> float:
        return (t - self.t0) * 1e6

    def _add(self, ev: dict) -> None:
        with self._lock:
            self.events.append(ev)

    @contextlib.contextmanager
    def span(self, name: str, lane: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self._add({"name": name, "cat": "compute", "ph": "X", "pid": self.rank,
                       "tid": lane, "ts": self._us(start), "dur": self._us(end) - self._us(start)})

    def collective(self, name: str, lane: str, work, start: float | None = None) -> None:
        """Record a collective from ``start`` (default: now) until ``work`` completes."""
        start = time.perf_counter() if start is None else start

        def done(_fut):
            end = time.perf_counter()
            self._add({"name": name, "cat": "comm", "ph": "X", "pid": self.rank, "tid": lane,
                       "ts": self._us(start), "dur": self._us(end) - self._us(start)})
            return None

        fut = getattr(work, "get_future", None)
        if fut is None:  # a skipped (no-op) collective
            done(None)
        else:
            fut().then(done)

    def save(self, path: Path) -> None:
        with self._lock:
            events = sorted(self.events, key=lambda e: e["ts"])
        Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
