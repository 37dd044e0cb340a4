"""A per-rank event trace: compute spans and collective lifetimes, as Chrome trace JSON.

Spans and collectives are stamped on the device's timeline (:mod:`oases.parallel.timing`):
the host clock on the CPU, CUDA events on the current stream on CUDA, where a host
clock would only see the launches. A collective lasts from its launch to its
completion, the end stamped by the work's future callback: on the CPU it fires on the
communication thread when the collective ends; on CUDA it runs on a stream that waits
for the collective, so its event completes when the collective does. The trace shows
which collectives ran while which compute did; the stamps are read when it is saved.

The same names label ``torch.profiler`` ranges (:func:`engine_span`; ``profile.steps``,
:mod:`oases.runtime.profiling`), where the device's own timeline shows the overlap.
"""

from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path

from oases.parallel.comm import CommObserver
from oases.parallel.timing import DeviceLike, Stamp, between, label, stamp


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


def engine_span(tracer, name: str, lane: str = "compute"):
    """The engine's span ``name``: a profiler range (when one records) and, with a
    tracer, a span on its ``lane``."""
    if tracer is None:
        return label(name)
    return _both(label(name), tracer.span(name, lane))


class Tracer(CommObserver):
    """``with tracer:`` also records the collectives issued through
    :func:`oases.parallel.comm.all_reduce` (e.g. inside autograd under ``megatron``).
    ``device``: whose timeline the stamps are on (None: the host clock)."""

    def __init__(self, rank: int, device: DeviceLike = None) -> None:
        self.rank = rank
        self.device = device
        self._lock = threading.Lock()
        self.restart()

    def restart(self) -> None:
        """Drop what was recorded; the trace's time 0 is now."""
        with self._lock:
            self.events: list[tuple[str, str, str, Stamp, Stamp]] = []
            self.t0 = stamp(self.device)

    def _add(self, name: str, cat: str, lane: str, start: Stamp, end: Stamp) -> None:
        with self._lock:
            self.events.append((name, cat, lane, start, end))

    @contextlib.contextmanager
    def span(self, name: str, lane: str):
        start = stamp(self.device)
        try:
            yield
        finally:
            self._add(name, "compute", lane, start, stamp(self.device))

    def collective(self, name: str, lane: str, work, start: Stamp | None = None) -> None:
        """Record a collective from ``start`` (default: now) until ``work`` completes."""
        if start is None:
            start = stamp(self.device)

        def done(_fut):
            self._add(name, "comm", lane, start, stamp(self.device))
            return None

        fut = getattr(work, "get_future", None)
        if fut is None:  # a skipped (no-op) collective
            done(None)
        else:
            fut().then(done)

    def save(self, path: Path) -> None:
        with self._lock:
            raw = list(self.events)
        events = [{"name": name, "cat": cat, "ph": "X", "pid": self.rank, "tid": lane,
                   "ts": between(self.t0, a) * 1e6, "dur": between(a, b) * 1e6}
                  for name, cat, lane, a, b in raw]
        events.sort(key=lambda e: e["ts"])
        Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
