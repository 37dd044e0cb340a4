"""File faults for the checkpoint path: every file operation under a directory counted,
one of them made to fail or to be the point where the process dies.

    with FileFaults(root, at=7, err=errno.ENOSPC) as faults:   # the 8th operation fails
        ckpt.save(...)
    faults.ops            # [(kind, path), ...]: every operation seen under root

Operations counted (paths under ``root`` only, in any thread): ``mkdir``; ``open`` for
writing; ``write``, the first write to each file opened for writing (the bytes of a
file are one operation: a fault there leaves the file empty or torn); ``fsync``, of a
file or a directory (counted but not done: what a test can observe is the order, and
skipping the disk flush keeps each save a few milliseconds); ``rename`` (rename and
replace); ``unlink``; ``rmdir``.

What happens at the chosen operation (``at``: its index; or ``match``: the first whose
kind is ``match[0]`` and whose path ends with ``match[1]``):

* ``err``: it raises ``OSError(err)`` and has no effect; later operations run;
* ``kill=True``: it and every later operation raise :class:`Killed` and have no effect,
  as if the process had been killed there (nothing after that point reaches the disk;
  bytes already handed to a Python file object may still be flushed, which a real kill
  would lose: the checks rest on the order of operations, which is exact);
* ``sigkill=True``: the process sends itself SIGKILL (a real ``kill -9``), for runs
  under torchrun.

``tests/support/fault_train.py`` installs one from the environment around ``train.py``'s main.
"""

from __future__ import annotations

import builtins
import errno as errnos
import io
import json
import os
import signal
import threading
from pathlib import Path
from typing import Optional

KINDS = ("mkdir", "open", "write", "fsync", "rename", "unlink", "rmdir")


class Killed(BaseException):
    """The simulated death of the process at a file operation."""


class _Writer:
    """A file opened for writing: its first write is an operation."""

    def __init__(self, f, path: str, faults: "FileFaults") -> None:
        self._f, self._path, self._faults, self._wrote = f, path, faults, False

    def write(self, b):
        if not self._wrote:
            self._wrote = True
            self._faults.op("write", self._path)
        elif self._faults.killed:
            raise Killed(f"killed before writing {self._path}")
        return self._f.write(b)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._f, name)


class FileFaults:
    def __init__(self, root: str | Path, at: Optional[int] = None,
                 match: Optional[tuple[str, str]] = None, err: int = errnos.ENOSPC,
                 kill: bool = False, sigkill: bool = False) -> None:
        self.root = os.path.abspath(root)
        self.at, self.match, self.err = at, match, err
        self.kill, self.sigkill = kill, sigkill
        self.ops: list[tuple[str, str]] = []
        self.hit: Optional[tuple[str, str]] = None  # the operation the fault took
        self.killed = False
        self._lock = threading.Lock()
        self._saved: dict = {}

    # ----------------------------------------------------------------- bookkeeping

    def _under(self, path) -> Optional[str]:
        try:
            p = os.path.abspath(os.fspath(path))
        except TypeError:
            return None
        return p if p == self.root or p.startswith(self.root + os.sep) else None

    def op(self, kind: str, path: str) -> None:
        """Count operation ``kind`` on ``path`` (under root); fail it if chosen."""
        with self._lock:
            if self.killed:
                raise Killed(f"killed before {kind} {path}")
            i = len(self.ops)
            self.ops.append((kind, path))
            chosen = (self.hit is None and
                      (i == self.at if self.match is None
                       else kind == self.match[0] and path.endswith(self.match[1])))
            if not chosen:
                return
            self.hit = (kind, path)
            if self.sigkill:
                os.kill(os.getpid(), signal.SIGKILL)
            if self.kill:
                self.killed = True
                raise Killed(f"killed at {kind} {path}")
        raise OSError(self.err, os.strerror(self.err), path)

    # ----------------------------------------------------------------- patches

    def _path_at(self, name, dir_fd) -> str:
        if dir_fd is None:
            return os.path.abspath(os.fspath(name))
        return os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), os.fspath(name))

    def _wrap(self, kind: str, real, two_paths: bool = False):
        def wrapped(*args, **kw):
            path = self._under(self._path_at(args[0], kw.get("dir_fd")))
            if path is None and two_paths:
                path = self._under(args[1])
            if path is not None:
                self.op(kind, path)
            return real(*args, **kw)
        return wrapped

    def _fsync(self, real):
        def fsync(fd):
            num = fd if isinstance(fd, int) else fd.fileno()
            try:
                path = self._under(os.readlink(f"/proc/self/fd/{num}"))
            except OSError:
                path = None
            if path is None:
                return real(fd)
            self.op("fsync", path)  # counted, not done: durability is not observable here
        return fsync

    def _open(self, real):
        def open_(file, mode="r", *args, **kw):
            path = self._under(file) if isinstance(file, (str, os.PathLike)) else None
            writing = any(c in mode for c in "wax+")
            if path is None or not writing:
                return real(file, mode, *args, **kw)
            self.op("open", path)
            return _Writer(real(file, mode, *args, **kw), path, self)
        return open_

    def __enter__(self) -> "FileFaults":
        patches = {
            (os, "mkdir"): self._wrap("mkdir", os.mkdir),
            (os, "rename"): self._wrap("rename", os.rename, True),
            (os, "replace"): self._wrap("rename", os.replace, True),
            (os, "unlink"): self._wrap("unlink", os.unlink),
            (os, "remove"): self._wrap("unlink", os.remove),
            (os, "rmdir"): self._wrap("rmdir", os.rmdir),
            (os, "fsync"): self._fsync(os.fsync),
            (builtins, "open"): self._open(builtins.open),
            (io, "open"): self._open(io.open),
        }
        for (mod, name), fn in patches.items():
            self._saved[(mod, name)] = getattr(mod, name)
            setattr(mod, name, fn)
        return self

    def __exit__(self, *exc) -> None:
        for (mod, name), fn in self._saved.items():
            setattr(mod, name, fn)
        self._saved.clear()


def install_from_env() -> Optional[FileFaults]:
    """``OASES_TEST_FAULT='{"rank": 1, "root": DIR, "match": [KIND, SUFFIX], "err": "ENOSPC"
    | "sigkill": true}'``: the fault for this process (its RANK), entered for good."""
    spec = os.environ.get("OASES_TEST_FAULT")
    if not spec:
        return None
    spec = json.loads(spec)
    if int(os.environ.get("RANK", "0")) != spec["rank"]:
        return None
    return FileFaults(spec["root"], match=tuple(spec["match"]),
                      err=getattr(errnos, spec.get("err", "ENOSPC")),
                      sigkill=bool(spec.get("sigkill"))).__enter__()
