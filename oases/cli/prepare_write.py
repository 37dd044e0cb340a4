"""Token shards of ``python -m oases.prepare``: each split (train, val) is written as
shards of at most ``--shard-tokens`` tokens, under temporary names until the whole run
has succeeded, then renamed: ``train.bin`` when one shard holds the split (the layout
of a small corpus), else ``train-00000.bin``, ``train-00001.bin``, ... ``meta.json``
lists every shard with its token count, largest id and documents, and the loader
(:mod:`oases.runtime.tokens`) reads the list as one corpus.

The whole corpus is written into a directory beside ``--out`` (:class:`Staging`) and
swapped in whole once it is complete, so ``--out`` holds the old corpus or the new
one, never a mix of both, whatever stops the run.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Optional

import numpy as np

from oases.errors import DataError

SPLITS = ("train", "val")
_SHARD_RE = re.compile(r"^(train|val)(-\d{5})?\.(bin|flags)(\.tmp)?$")


def existing_outputs(out: Path) -> list[Path]:
    """Token shards (finished or left by an interrupted run) and meta.json in ``out``."""
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir() if _SHARD_RE.match(p.name) or p.name == "meta.json")


def check_out(out: Path, force: bool) -> list[Path]:
    """Refuse an output that is already there (all or part of a shard set) without
    ``force``; returns what a forced run replaces once it has succeeded."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} exists and is not a directory")
    old = existing_outputs(out)
    if old and not force:
        shards = [p for p in old if p.name != "meta.json"]
        complete = (out / "meta.json").is_file() and not any(p.suffix == ".tmp" for p in old)
        what = "holds a prepared corpus" if complete else "holds a partial shard set"
        names = ", ".join(p.name for p in shards[:3]) + (" ..." if len(shards) > 3 else "")
        raise DataError(f"--out {out} {what} ({names or 'meta.json'}) and it already exists; "
                        f"pass --force to overwrite")
    return old


# renameat2(2)'s flag that swaps two paths atomically (Linux >= 3.15; glibc >= 2.28)
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the directories ``a`` and ``b`` in one step; False where the C library or
    the filesystem does not offer it (the caller then renames twice)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Staging:
    """A directory beside ``--out`` (same parent, so the same filesystem) that receives
    the whole new corpus; :meth:`publish` swaps it in for ``--out`` in one step and
    keeps whatever else ``--out`` held; :meth:`discard` removes it. A killed run leaves
    it behind as ``.NAME.prepare-*``, next to an untouched ``--out``."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.target = Path(os.path.realpath(out))  # a symlinked --out: its directory
        if os.path.ismount(self.target):
            raise DataError(f"--out {out} is a mount point; the corpus is written beside "
                            f"--out and swapped in whole, so give a directory inside it "
                            f"(such as {out}/corpus)")
        try:
            self.target.parent.mkdir(parents=True, exist_ok=True)
            self.dir = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.prepare-",
                                             dir=self.target.parent))
        except OSError as e:
            raise DataError(f"cannot create the new corpus beside --out {out} (in "
                            f"{self.target.parent}): {e.strerror or e}") from None
        self.swapped = False

    def publish(self) -> None:
        """Make the staged corpus ``--out``: renamed into place when there is no ``--out``,
        else swapped with it, the old ``--out``'s other entries moved over and the old
        corpus deleted."""
        _fsync_dir(self.dir)
        if not self.target.exists():
            os.rename(self.dir, self.target)
            _fsync_dir(self.target.parent)
            return
        if not _exchange(self.dir, self.target):
            # no atomic swap here: --out is missing for the moment between the renames
            # (the old corpus then sits in the staging directory's place), never mixed
            aside = self.dir.with_name(self.dir.name + ".old")
            os.rename(self.target, aside)
            try:
                os.rename(self.dir, self.target)
            except OSError:
                os.rename(aside, self.target)
                raise
            os.rename(aside, self.dir)
        self.swapped = True  # from here self.dir is the old --out: never discarded
        _fsync_dir(self.target.parent)
        for p in self.dir.iterdir():  # keep what the old --out held besides its corpus
            if not (_SHARD_RE.match(p.name) or p.name == "meta.json"):
                try:
                    os.rename(p, self.target / p.name)
                except OSError as e:
                    raise DataError(f"the new corpus is in --out {self.out}, but {p.name} "
                                    f"could not be moved over from the old one, kept in "
                                    f"{self.dir}: {e.strerror or e}") from None
        shutil.rmtree(self.dir, ignore_errors=True)

    def discard(self) -> None:
        """Remove the staged corpus (a failed run); nothing once the swap is done."""
        if not self.swapped:
            shutil.rmtree(self.dir, ignore_errors=True)


class Router:
    """Which split document ``i`` (0-based, in input order) goes to: the first
    ``val_docs`` documents, or with ``val_fraction`` f every document where
    floor((i + 1) f) steps up: an exact share, spread evenly over the corpus."""

    def __init__(self, val_fraction: float, val_docs: Optional[int]) -> None:
        self.val_docs = val_docs
        f = Fraction(str(val_fraction)).limit_denominator(1 << 20)
        self.num, self.den = f.numerator, f.denominator

    def is_val(self, docs: np.ndarray) -> np.ndarray:
        if self.val_docs is not None:
            return docs < self.val_docs
        return (docs + 1) * self.num // self.den > docs * self.num // self.den


class ShardWriter:
    """One split's shards, written in order under ``.tmp`` names. ``ext``: ``bin`` for
    token ids; ``flags`` for a chat corpus's per-token flags, written in lockstep with
    its tokens so that both cut their shards at the same tokens."""

    def __init__(self, out: Path, split: str, dtype: np.dtype, shard_tokens: int,
                 ext: str = "bin") -> None:
        self.out, self.split, self.dtype, self.limit = out, split, dtype, shard_tokens
        self.ext = ext
        self.shards: list[dict] = []  # per shard: tmp path, tokens, max_id, docs
        self._f = None

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards)

    @property
    def docs(self) -> int:
        return sum(s["docs"] for s in self.shards)

    def _open(self) -> dict:
        tmp = self.out / f"{self.split}-{len(self.shards):05d}.{self.ext}.tmp"
        self.close()
        self._f = open(tmp, "wb")
        self.shards.append({"tmp": tmp, "tokens": 0, "max_id": -1, "docs": 0})
        return self.shards[-1]

    def write(self, ids: np.ndarray, docs_ended: int) -> None:
        """Append ``ids`` (in which ``docs_ended`` documents end), cutting shards."""
        while len(ids):
            cur = self.shards[-1] if self.shards and self._f else self._open()
            if cur["tokens"] >= self.limit:
                cur = self._open()
            take = ids[:self.limit - cur["tokens"]]
            self._f.write(take.astype(self.dtype, copy=False).tobytes())
            cur["tokens"] += len(take)
            cur["max_id"] = max(cur["max_id"], int(take.max()))
            ids = ids[len(take):]
        if docs_ended:
            (self.shards[-1] if self.shards else self._open())["docs"] += docs_ended

    def close(self, sync: bool = True) -> None:
        if self._f is not None:
            try:
                if sync:  # on disk before the corpus is swapped in
                    self._f.flush()
                    os.fsync(self._f.fileno())
            finally:
                self._f.close()
                self._f = None

    def take_tail(self, n: int) -> list[np.ndarray]:
        """Remove the last ``n`` tokens (a one-document corpus's val part), in order."""
        self.close()
        parts: list[np.ndarray] = []
        while n > 0:
            s = self.shards[-1]
            k = min(n, s["tokens"])
            arr = np.fromfile(s["tmp"], dtype=self.dtype, offset=(s["tokens"] - k) *
                              self.dtype.itemsize)
            parts.insert(0, arr)
            s["tokens"] -= k
            os.truncate(s["tmp"], s["tokens"] * self.dtype.itemsize)
            if s["tokens"] == 0:
                s["tmp"].unlink()
                self.shards.pop()
            else:
                s["max_id"] = _max_id(s["tmp"], self.dtype)
            n -= k
        return parts

    def finish(self) -> list[dict]:
        """Rename the shards to their final names; returns meta.json's entries."""
        self.close()
        single = len(self.shards) == 1
        entries = []
        for i, s in enumerate(self.shards):
            name = f"{self.split}.{self.ext}" if single else f"{self.split}-{i:05d}.{self.ext}"
            os.replace(s["tmp"], self.out / name)
            entries.append({"file": name, "tokens": s["tokens"], "max_id": s["max_id"],
                            "docs": s["docs"]})
        return entries

    def discard(self) -> None:
        try:
            self.close(sync=False)
        except OSError:
            pass  # a full disk: the staged corpus goes whole
        for s in self.shards:
            s["tmp"].unlink(missing_ok=True)


def _max_id(path: Path, dtype: np.dtype, chunk: int = 1 << 24) -> int:
    arr = np.memmap(path, dtype=dtype, mode="r")
    return max((int(arr[a:a + chunk].max()) for a in range(0, len(arr), chunk)), default=-1)
