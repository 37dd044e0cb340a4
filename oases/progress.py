"""Progress of long work: a bar for a person at a terminal, a few lines for a log.

One policy for every long step of oases (tokenizing a corpus, profiling blocks,
writing and reading checkpoints, export):

* a tqdm bar on stderr only in a process of rank 0 that torchrun did not start,
  and only when stderr is a terminal;
* otherwise (a pipe, a log file, a batch job, every rank of a torchrun job) no
  bar and no carriage returns: rank 0 writes at most a few plain lines to stderr,
  and only for work that lasts more than a few seconds (at 5 s, then at 15, 35,
  75, ... s, each gap twice the last, and one when it ends), so a log stays
  line-oriented and a short job prints nothing extra.

Under torchrun the workers share the terminal (and the other ranks' output would
tear a bar apart), so a torchrun job always takes the line form.

    for item in progress(items, desc="profile", unit="block"):
        ...
    with io_progress("checkpoint step_000200", kind="write"):
        dcp.save(...)                  # bytes this process writes, polled from /proc
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Optional

# first line after this many seconds; each later gap twice the one before
FIRST_LINE_S = 5.0


def rank() -> int:
    """This process's global rank: from the process group when one is up, else $RANK."""
    dist = sys.modules.get("torch.distributed")  # never import torch just to ask
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def bars_enabled(stream=None) -> bool:
    """True when a bar may be drawn: rank 0, not under torchrun, ``stream`` (default
    stderr) a terminal, tqdm importable."""
    stream = sys.stderr if stream is None else stream
    if rank() != 0 or under_torchrun():
        return False
    try:
        if not stream.isatty():
            return False
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
    return importlib.util.find_spec("tqdm") is not None


def fmt_amount(n: float, unit: str) -> str:
    if unit == "B":
        for u in ("B", "KiB", "MiB", "GiB", "TiB"):
            if n < 1024 or u == "TiB":
                return f"{n:.0f} {u}" if u == "B" else f"{n:.1f} {u}"
            n /= 1024
    return f"{n:,.0f} {unit}"


class Lines:
    """The bar's stand-in off a terminal: iterates like the bar and takes the same
    ``update``/``close`` calls, and writes sparse plain lines on rank 0 (none at all
    with ``lines=False``, for callers that log every item themselves)."""

    def __init__(self, iterable: Optional[Iterable] = None, total: Optional[float] = None,
                 desc: str = "", unit: str = "it", lines: bool = True,
                 stream=None, first_line_s: float = FIRST_LINE_S) -> None:
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            self.total = len(iterable)  # type: ignore[arg-type]
        self.n = 0
        self._stream = stream
        self._on = lines and rank() == 0
        self._t0 = time.monotonic()
        self._first = self._next = first_line_s
        self._printed = 0

    def __iter__(self) -> Iterator:
        for item in self.iterable or ():
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> "Lines":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        self.n += n
        self.tick()

    def tick(self) -> None:
        """Write a line if one is due (also for work whose amount is not counted)."""
        if self._on and not (self.total and self.n >= self.total):  # then close() says it
            elapsed = time.monotonic() - self._t0
            if elapsed >= self._next:
                self._line(elapsed)
                self._next = 2 * elapsed + FIRST_LINE_S

    def close(self) -> None:
        elapsed = time.monotonic() - self._t0
        if self._on and (self._printed or elapsed >= self._first):  # long work: when it ended
            self._line(elapsed, done=True)
        self._on = False

    def _line(self, elapsed: float, done: bool = False) -> None:
        amount = fmt_amount(self.n, self.unit) if self.n else ""
        if self.total:
            pct = f"({100 * min(self.n / self.total, 1):.0f}%)"
            amount = (f"{fmt_amount(self.n, 'B')} of {fmt_amount(self.total, 'B')} {pct}"
                      if self.unit == "B" else f"{self.n:,.0f}/{self.total:,.0f} {self.unit} {pct}")
        if done:
            state = f"{amount + ', ' if amount else ''}done in {elapsed:.0f}s"
        else:
            state = f"{amount or 'running'} after {elapsed:.0f}s"
        print(f"{self.desc}: {state}", file=self._stream or sys.stderr, flush=True)
        self._printed += 1


def progress(iterable: Optional[Iterable] = None, total: Optional[float] = None,
             desc: str = "", unit: str = "it", lines: bool = True):
    """A tqdm bar over ``iterable`` (or for ``update`` calls) when :func:`bars_enabled`,
    else a :class:`Lines`. ``unit="B"`` counts bytes (KiB, MiB, ... on the bar)."""
    if not bars_enabled():
        return Lines(iterable, total, desc, unit, lines)
    from tqdm import tqdm  # deferred: only where bars are drawn (a terminal)

    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    big = unit == "B" or (total or 0) >= 10_000  # 1.2M/3.4M chars rather than every digit
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr, leave=False,
                dynamic_ncols=True, unit_scale=big, unit_divisor=1024 if unit == "B" else 1000)


def bar_safe(log: Callable[[str], None]) -> Callable[[str], None]:
    """``log`` wrapped so that its lines do not tear a bar drawn meanwhile (tqdm clears
    the bars, the line is printed, the bars are drawn again)."""
    if not bars_enabled():
        return log
    from tqdm import tqdm  # deferred: only where bars are drawn (a terminal)

    def write(msg: str) -> None:
        with tqdm.external_write_mode():
            log(msg)

    return write


def _io_counter(kind: str) -> Optional[Callable[[], int]]:
    """Bytes this process has read or written so far (Linux /proc/self/io: every
    thread, the files' bytes whether or not they came from the page cache), or None."""
    key = "rchar" if kind == "read" else "wchar"

    def read() -> int:
        with open("/proc/self/io") as f:
            for ln in f:
                if ln.startswith(key + ":"):
                    return int(ln.split()[1])
        raise OSError("no " + key)

    try:
        read()
    except (OSError, ValueError):
        return None
    return read


@contextmanager
def io_progress(desc: str, total: Optional[int] = None, kind: str = "write",
                interval_s: float = 0.25):
    """Progress of file I/O inside the block that this process cannot count itself (a
    library call such as DCP's save or load): a thread polls the bytes the process has
    read or written (``kind``) since the block began; without /proc, only the time."""
    counter = _io_counter(kind)
    base = counter() if counter else 0
    bar = progress(total=total, desc=desc, unit="B")
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(interval_s):
            done = counter() - base if counter else 0
            if total:
                done = min(done, total)  # metadata and imports are read too
            if done > bar.n:
                bar.update(done - bar.n)
            elif isinstance(bar, Lines):
                bar.tick()

    thread = threading.Thread(target=poll, name="oases-io-progress", daemon=True)
    thread.start()
    ok = False
    try:
        yield bar
        ok = True
    finally:
        stop.set()
        thread.join()
        if ok and total:
            bar.update(max(0, total - bar.n))  # done: full, even where nothing was counted
        bar.close()


def nbytes(tensors: Iterable) -> int:
    """Bytes of the tensors in ``tensors`` (other objects count 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if hasattr(t, "element_size"))
