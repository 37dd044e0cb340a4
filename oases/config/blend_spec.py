"""``data.train_paths``: the blend of token files a config names, checked (pure; the
sampler is :mod:`oases.runtime.blend`)."""

from __future__ import annotations

import glob
import math
from pathlib import Path
from typing import Any

from oases.errors import ConfigError

FORM = "{path: FILE, weight: W}"


def _weight(where: str, value: Any) -> float:
    """A blend weight: a finite number > 0 (a string only as YAML reads ``1e-3``)."""
    w = value
    if isinstance(value, str):
        try:
            w = float(value)
        except ValueError:
            w = None
    if not isinstance(w, (int, float)) or isinstance(w, bool):
        raise ConfigError(f"{where}.weight={value!r} is not a number")
    if not (w > 0 and math.isfinite(w)):
        raise ConfigError(f"{where}.weight={value!r} must be a finite number > 0")
    return float(w)


def _entry(i: int, entry: Any, check_files: bool) -> tuple[str, float]:
    where, form = f"data.train_paths[{i}]", FORM
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be a mapping {form}, got {entry!r}")
    unknown = sorted(str(k) for k in entry if k not in ("path", "weight"))
    if unknown:
        raise ConfigError(f"{where} has unknown key {unknown[0]!r}; an entry is {form}")
    for k in ("path", "weight"):
        if entry.get(k) is None:
            raise ConfigError(f"{where} needs a {k}; an entry is {form}")
    path = entry["path"]
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{where}.path={path!r} must be a file path")
    weight = _weight(where, entry["weight"])
    if check_files and not _names_data(Path(path)):
        what = "is a directory, not a token file" if Path(path).is_dir() else "does not exist"
        raise ConfigError(f"{where}.path={path} {what}")
    return path, weight


def _names_data(p: Path) -> bool:
    """Whether ``p`` can name a corpus (oases.runtime.tokens checks it): a file, a Megatron
    prefix, a glob with matches, or a split of a prepared directory (its meta.json)."""
    return (p.is_file() or p.with_name(p.name + ".idx").is_file() or bool(glob.glob(str(p)))
            or (not p.is_dir() and (p.parent / "meta.json").is_file()))


def check_blend(entries: Any, check_files: bool = True) -> list[tuple[str, float]]:
    """``train_paths`` checked, as ``[(path, weight), ...]`` with the weights
    normalised to sum 1. Every problem is a one-line ConfigError naming the entry."""
    if not isinstance(entries, list):
        raise ConfigError(f"data.train_paths must be a list of {FORM} mappings, "
                          f"got {type(entries).__name__}")
    if not entries:
        raise ConfigError(f"data.train_paths is empty; list at least one {FORM}")
    pairs = [_entry(i, e, check_files) for i, e in enumerate(entries)]
    seen: dict[str, int] = {}
    for i, (path, _) in enumerate(pairs):
        key = str(Path(path).resolve())
        if key in seen:
            raise ConfigError(f"data.train_paths[{seen[key]}] and [{i}] are both {path}; "
                              f"give the file one entry with the summed weight")
        seen[key] = i
    total = math.fsum(w for _, w in pairs)
    if not math.isfinite(total):
        raise ConfigError(f"data.train_paths weights sum to {total}; use smaller weights")
    return [(path, w / total) for path, w in pairs]
