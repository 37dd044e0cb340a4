"""A checkpoint's full (unsharded) model tensors, one at a time, without a process group:
what ``python -m oases.consolidate`` and ``python -m oases.export`` stream (fused parts
joined, vocabulary padding removed)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Iterator, Optional

import torch

from oases.errors import CheckpointError
from oases.runtime.ckpt_files import read_meta


def model_keys(path: Path, prefix: str = "model", reader=None) -> tuple[dict, dict[str, list]]:
    """(meta, parameter name -> (key, storage metadata) of its keys, parts in order) of
    the tensors of a checkpoint under ``prefix`` (``model``, ``optim.exp_avg``, ...);
    ``reader``: a :func:`reader_for` to read its metadata with (kept for the load)."""
    from oases.runtime.ckpt_format import read_metadata  # deferred: imports DCP

    meta = read_meta(path)
    names: dict[str, dict[int, object]] = {}
    for key, md in read_metadata(path, reader).items():
        if not key.startswith(prefix + "/"):
            continue
        name = key[len(prefix) + 1:]
        base, _, idx = name.rpartition(".part")
        if base and idx.isdigit():
            names.setdefault(base, {})[int(idx)] = (key, md)
        else:
            names[name] = {0: (key, md)}
    if not names:
        raise CheckpointError(f"checkpoint {path} holds no {prefix} tensors")
    return meta, {n: [ps[i] for i in sorted(ps)] for n, ps in sorted(names.items())}


def full_shape(meta: dict, name: str, keys: list) -> tuple[tuple, torch.dtype]:
    """Shape (fused parts joined, vocabulary padding removed) and dtype of ``name``."""
    dim, logical = _unpad(meta, name)
    shape = list(keys[0][1].size)
    if len(keys) > 1:
        shape[dim] = sum(md.size[dim] for _, md in keys)
    if logical is not None and shape[dim] > logical:
        shape[dim] = logical
    return tuple(shape), keys[0][1].properties.dtype


def _unpad(meta: dict, name: str) -> tuple[int, Optional[int]]:
    info = (meta.get("layout") or {}).get(name)
    if info is not None:
        return info.get("dim", 0), info.get("logical")
    vocab = (meta.get("model_shape") or {}).get("vocab_size")
    if name in ("embed.wte.weight", "head.weight") and vocab:  # a checkpoint without layout
        return 0, vocab
    return 0, None


def iter_model_tensors(path: Path, prefix: str = "model",
                       batch_bytes: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's full tensors (``prefix``: or those of an Adam moment) from a
    checkpoint, in name order: fused parts joined, vocabulary padding removed. Tensors
    are read in batches of about ``batch_bytes`` (0: one at a time), so only the batch in
    hand is in memory (plus DCP's read of one saved chunk). Reads alone: needs no process
    group and issues no collective."""
    from oases.runtime.ckpt_format import (  # deferred: imports DCP
        chunk_name, load_windows, reader_for)

    reader = reader_for(path)
    meta, names = model_keys(path, prefix, reader)
    batch: list[tuple[str, torch.Tensor]] = []
    windows: dict = {}
    for i, (name, keys) in enumerate(names.items()):
        shape, dtype = full_shape(meta, name, keys)
        dim, _ = _unpad(meta, name)
        out = torch.empty(shape, dtype=dtype)
        off = 0
        for key, md in keys:
            zeros = (0,) * len(md.size)
            if not md.size:  # a scalar
                windows[chunk_name(key, zeros)] = (out, key, zeros)
                continue
            n = min(md.size[dim], shape[dim] - off)
            if n > 0:
                windows[chunk_name(key, zeros)] = (out.narrow(dim, off, n), key, zeros)
            off += n
        batch.append((name, out))
        if i == len(names) - 1 or sum(t.nbytes for _, t in batch) >= batch_bytes:
            with warnings.catch_warnings():  # "torch.distributed is ... uninitialized"
                warnings.simplefilter("ignore", UserWarning)
                load_windows(path, windows, reader, alone=True)
            yield from batch
            batch, windows = [], {}


def full_model_state(path: Path, prefix: str = "model") -> dict[str, torch.Tensor]:
    """Every full model tensor of a checkpoint in one dict, read at once (small models,
    tests)."""
    return dict(iter_model_tensors(path, prefix, batch_bytes=1 << 62))
