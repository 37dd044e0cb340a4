"""Token shards of ``python -m oases.prepare``: each split (train, val) is written as
shards of at most ``--shard-tokens`` tokens, under temporary names until the whole run
has succeeded, then renamed: ``train.bin`` when one shard holds the split (the layout
of a small corpus), else ``train-00000.bin``, ``train-00001.bin``, ... ``meta.json``
lists every shard with its token count, largest id and documents, and the loader
(:mod:`oases.runtime.tokens`) reads the list as one corpus.
"""

from __future__ import annotations

import os
import re
from fractions import Fraction
from pathlib import Path
from typing import Optional

import numpy as np

from oases.errors import DataError

SPLITS = ("train", "val")
_SHARD_RE = re.compile(r"^(train|val)(-\d{5})?\.bin(\.tmp)?$")


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
    """One split's shards, written in order under ``.tmp`` names."""

    def __init__(self, out: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.out, self.split, self.dtype, self.limit = out, split, dtype, shard_tokens
        self.shards: list[dict] = []  # per shard: tmp path, tokens, max_id, docs
        self._f = None

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards)

    @property
    def docs(self) -> int:
        return sum(s["docs"] for s in self.shards)

    def _open(self) -> dict:
        tmp = self.out / f"{self.split}-{len(self.shards):05d}.bin.tmp"
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

    def close(self) -> None:
        if self._f is not None:
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
            name = f"{self.split}.bin" if single else f"{self.split}-{i:05d}.bin"
            os.replace(s["tmp"], self.out / name)
            entries.append({"file": name, "tokens": s["tokens"], "max_id": s["max_id"],
                            "docs": s["docs"]})
        return entries

    def discard(self) -> None:
        self.close()
        for s in self.shards:
            s["tmp"].unlink(missing_ok=True)


def _max_id(path: Path, dtype: np.dtype, chunk: int = 1 << 24) -> int:
    arr = np.memmap(path, dtype=dtype, mode="r")
    return max((int(arr[a:a + chunk].max()) for a in range(0, len(arr), chunk)), default=-1)
