"""The checkpoint directory on disk: names, durable writes, publishing, pruning, and
which checkpoint a resume takes.

    <out_dir>/checkpoints/
        step_000040/        published: DCP files + .metadata + meta.json + rng/
        step_000040.tmp/    a save in progress, or what a crash or a failed save left
        step_000020.del/    a checkpoint being pruned
        latest              the name of the newest published checkpoint

A publish (rank 0, once every rank's files are in ``step_N.tmp``) makes each step
durable before the next, so that ``latest`` only ever names a checkpoint whose files
are on disk, after a crash and, on a filesystem that honours ``fsync``, after a power
loss:

    1. every rank's files in step_N.tmp/, each fsynced by its writer (DCP fsyncs its
       own; rng/rank*.pt by their rank)
    2. meta.json written and fsynced; step_N.tmp/rng/ and step_N.tmp/ fsynced
    3. step_N.tmp renamed step_N; checkpoints/ fsynced
    4. latest.tmp written and fsynced, renamed latest; checkpoints/ fsynced
    5. pruning: published checkpoints older than step_N beyond ``keep`` renamed .del
       (checkpoints/ fsynced), then removed

Pruning only ever removes checkpoints older than the one just published, so neither
``latest``'s target nor a newer directory that a crash between steps 3 and 4 left is
touched; names are ordered by their integer step (``step_1000000`` after
``step_999999``).

A resume takes ``latest``'s target; when it is missing or unreadable (a power loss on
a filesystem that does not honour fsync, a directory removed by hand), the newest
complete checkpoint instead, and says so in one line (:func:`find_checkpoint`).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Optional

import torch

from oases.errors import CheckpointError, first_line

LATEST = "latest"
_STEP_RE = re.compile(r"step_(\d+)")
# fsync of a directory is refused by some filesystems: nothing more can be done there
_DIR_FSYNC_UNSUPPORTED = (errno.EINVAL, errno.ENOTSUP, errno.EBADF)


def ckpt_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def step_of(name: str) -> Optional[int]:
    """The step of a published checkpoint's name (``step_000040`` -> 40), else None."""
    m = _STEP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def step_dirs(root: Path) -> list[Path]:
    """The published checkpoint directories under ``root``, oldest step first."""
    if not root.is_dir():
        return []
    found = [(step_of(p.name), p) for p in root.iterdir()]
    return [p for s, p in sorted((s, p) for s, p in found if s is not None and p.is_dir())]


def is_complete(path: Path) -> bool:
    return (path / "meta.json").is_file() and (path / ".metadata").is_file()


def read_meta(path: Path) -> dict:
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path} has an unreadable meta.json: {e}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise CheckpointError(f"checkpoint {path} has a meta.json without a step")
    return meta


# ---------------------------------------------------------------------------
# Durable writes


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _DIR_FSYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes) -> None:
    """``data`` as the file ``path``, fsynced (the directory entry is the caller's)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst`` (atomically replacing it) and make the rename durable."""
    os.replace(src, dst)
    fsync_dir(dst.parent)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace the file ``path`` by ``data`` whole: the old or the new, never a mix."""
    tmp = path.with_name(path.name + ".tmp")
    write_file(tmp, data)
    replace(tmp, path)


def save_tensors(obj: dict, path: Path) -> None:
    """``torch.save`` to ``path``, fsynced."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def remove_tree(path: Path) -> None:
    """Remove a directory that nothing reads any more (a .tmp or .del); what cannot be
    removed now is removed by the next save."""
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------
# A save's directories, publishing, pruning


def start_tmp(root: Path, tmp: Path) -> None:
    """Rank 0 at the start of a save: remove what an earlier crash or failure left
    (.tmp and .del directories), create ``tmp`` and ``tmp/rng``."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in sorted([*root.glob("*.tmp"), *root.glob("*.del")]):
        if stale.is_dir():
            remove_tree(stale)
    tmp.mkdir()
    (tmp / "rng").mkdir()


def publish(root: Path, tmp: Path, final: Path, meta: dict, keep: int) -> None:
    """Steps 2-5 of the module docstring (rank 0, once every rank's files are in
    ``tmp``). An OSError leaves ``latest`` naming a complete checkpoint: the one it
    named before, or ``final`` once step 4 is done."""
    write_file(tmp / "meta.json", json.dumps(meta, indent=1).encode())
    fsync_dir(tmp / "rng")
    fsync_dir(tmp)
    if final.exists():  # a stray directory a crash left before `latest` named it
        aside = final.with_name(final.name + ".del")
        replace(final, aside)
        remove_tree(aside)
    replace(tmp, final)
    write_atomic(root / LATEST, (final.name + "\n").encode())
    prune(root, final, keep)


def prune(root: Path, published: Path, keep: int) -> list[Path]:
    """Remove the published checkpoints older than ``published`` beyond the newest
    ``keep`` (``published`` counted); returns those removed. A directory newer than
    ``published`` is never touched (it is not counted either)."""
    step = step_of(published.name)
    older = [p for p in step_dirs(root) if step_of(p.name) < step]
    gone = older[:max(len(older) - (keep - 1), 0)]
    for old in gone:  # renamed first: a crash mid-delete leaves no partial step_N
        replace(old, old.with_name(old.name + ".del"))
    for old in gone:
        remove_tree(old.with_name(old.name + ".del"))
    return gone


# ---------------------------------------------------------------------------
# Which checkpoint a resume takes


def unusable(path: Path) -> Optional[str]:
    """Why the checkpoint at ``path`` cannot be loaded (None: it can): missing, or its
    meta.json or DCP .metadata unreadable."""
    from oases.runtime.ckpt_format import read_metadata  # deferred: imports DCP

    if not path.is_dir():
        return "missing"
    try:
        read_meta(path)
        read_metadata(path)
    except CheckpointError as e:
        return str(e).replace(f"checkpoint {path} ", "", 1)
    return None


def latest_target(root: Path) -> tuple[Optional[Path], Optional[str]]:
    """(the checkpoint ``latest`` names, or None; why it cannot be resumed, or None)."""
    ptr = root / LATEST
    if not ptr.exists():
        return None, f"{ptr} is missing"
    try:
        name = ptr.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        return None, f"{ptr} is unreadable ({first_line(e)})"
    if step_of(name) is None:
        return None, f"{ptr} names {name!r}, not a checkpoint"
    path = root / name
    why = unusable(path)
    return path, None if why is None else (f"checkpoint {path} named by {ptr} is partial or "
                                           f"missing ({why})")


def find_checkpoint(out_dir: str | Path) -> tuple[Optional[Path], Optional[str]]:
    """(the checkpoint to resume from, a line saying why it is not ``latest``'s target
    or None). None when the run has no checkpoint at all; a CheckpointError when it has
    checkpoints but none can be loaded (never start over silently)."""
    root = ckpt_root(out_dir)
    named, why = latest_target(root)
    if why is None:
        return named, None
    dirs = step_dirs(root)
    if not dirs and not (root / LATEST).exists():
        return None, None
    for cand in reversed(dirs):
        if cand != named and unusable(cand) is None:
            return cand, f"{why}; resuming from the newest complete checkpoint {cand}"
    raise CheckpointError(f"{why}, and no other checkpoint in {root} is complete; move {root} "
                          f"away to start the run over")


def latest_name(out_dir: str | Path) -> Optional[str]:
    """The checkpoint ``latest`` names (for messages), or None."""
    try:
        return str(ckpt_root(out_dir) / (ckpt_root(out_dir) / LATEST).read_text().strip())
    except (OSError, UnicodeDecodeError):
        return None
