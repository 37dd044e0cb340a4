"""One run per ``out_dir``, and an ``out_dir`` that every rank sees.

**The lock.** Rank 0 holds an exclusive ``fcntl.flock`` on ``<out_dir>/.lock`` from the
run's first write into ``out_dir`` to its end; the file names the holder (host, pid, a
token for this run). A second run in the same directory (a double launch, a requeued job
that overlaps the one still running) is refused with exit status 2 and the holder's host
and pid: at once when it starts (a check that writes nothing), and at the latest before
its own first write. Taking the lock only then leaves out_dir untouched by a run that
stops on bad input first. The kernel drops the lock when the holder dies, however it
dies, so a crash never leaves a stale lock behind (the file may stay; a run that ends
removes it). On a filesystem without ``flock`` (some Lustre mounts) the run says so in
one line and goes on unlocked.

**Shared.** Every rank writes its checkpoint shards into one directory, so ``out_dir``
must be the same directory on every node. When rank 0 takes the lock, each rank reads
``.lock`` and compares the token with rank 0's; a resume first checks that every rank
sees the checkpoint rank 0 chose. A rank that does not (``out_dir`` on a node-local
disk) stops the run there, on every rank alike, instead of at the first save.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import uuid
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from oases.errors import CheckpointError, UserError
from oases.runtime.ckpt_files import write_file

LOCK_NAME = ".lock"
_HELD = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)  # flock's "another holds it"


class RunLock:
    """The exclusive lock of a run directory, held from :meth:`acquire` to :meth:`release`
    (or the process's end)."""

    def __init__(self, out_dir: str | Path) -> None:
        self.path = Path(out_dir) / LOCK_NAME
        self.token = uuid.uuid4().hex
        self._fd: Optional[int] = None

    def refuse_if_held(self) -> None:
        """UserError naming the holder if another run holds the lock now. Writes nothing,
        so a run that then stops on bad input leaves out_dir as it was; :meth:`acquire`
        takes the lock before the run's first write."""
        try:
            fd = os.open(self.path, os.O_RDWR)  # NFS locks a file opened for writing
        except OSError:
            return  # no lock file: no run holds it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in _HELD:
                raise self._in_use() from None
        finally:
            os.close(fd)  # and with it the lock, if it was taken

    def acquire(self) -> None:
        """Take the lock and write this run's host, pid and token into it; UserError
        naming the holder if another run has it. Once per run: a second call does
        nothing."""
        if self._fd is not None:
            return
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in _HELD:
                    raise self._in_use() from None
                print(f"warning: out_dir {self.path.parent} does not support file locks "
                      f"({e.strerror}); nothing stops a second run from using it", flush=True)
                write_file(self.path, self._record())
                return
            if _same_file(fd, self.path):
                break
            os.close(fd)  # the holder removed the file between our open and our lock
        self._fd = fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, self._record(), 0)
        os.fsync(fd)

    def _in_use(self) -> UserError:
        return UserError(f"out_dir {self.path.parent} is in use by another run "
                         f"({holder(self.path)}); wait for it to end, stop it, or choose "
                         f"another out_dir")

    def _record(self) -> bytes:
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                           "token": self.token}).encode() + b"\n"

    def release(self) -> None:
        """Remove the lock file and drop the lock (the file goes first: a run that opened
        it meanwhile finds, once it has the lock, that it is not the file at the path any
        more, and opens the path again)."""
        if self._fd is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            os.close(self._fd)
            self._fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def holder(path: Path) -> str:
    """``host H, pid P`` of the run that wrote the lock file ``path``."""
    try:
        rec = json.loads(path.read_text())
        return f"host {rec['host']}, pid {rec['pid']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "host and pid unknown"


def check_shared(out_dir: str | Path, token: Optional[str]) -> None:
    """Every rank checks that it sees rank 0's lock file (``token``: rank 0's; ignored
    elsewhere). Collective over the world; CheckpointError on every rank, naming the
    ranks and hosts that do not see it."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    sent = [token]
    dist.broadcast_object_list(sent, src=0)
    path = Path(out_dir) / LOCK_NAME
    try:
        seen = json.loads(path.read_text()).get("token") == sent[0]
    except (OSError, ValueError, AttributeError):
        seen = False
    require_seen(out_dir, path, seen)


def require_seen(out_dir: str | Path, path: Path, seen: bool) -> None:
    """CheckpointError on every rank unless every rank sees ``path`` (``seen``: whether
    this one does), which rank 0 wrote or found in ``out_dir`` (collective)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (socket.gethostname(), seen))
    blind = [(r, host) for r, (host, ok) in enumerate(every) if not ok]
    if blind:
        where = ", ".join(f"rank {r} on {host}" for r, host in blind[:4])
        more = f" and {len(blind) - 4} more" if len(blind) > 4 else ""
        raise CheckpointError(
            f"out_dir {out_dir} is not shared: {where}{more} cannot see the {path} that "
            f"rank 0 sees on {every[0][0]}; every rank writes its checkpoint shards there, "
            f"so out_dir must be one directory on a filesystem every node mounts")
