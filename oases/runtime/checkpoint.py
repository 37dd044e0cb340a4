"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): each rank writes what it owns.

Layout under ``<out_dir>/checkpoints``:

    step_000040/          a complete checkpoint (DCP files + meta.json + rng/)
    step_000040.tmp/      a save in progress (ignored; removed by the next save)
    step_000020.del/      an old checkpoint being pruned (ignored; removed by the next save)
    latest                the name of the newest complete checkpoint

A save writes everything into ``step_N.tmp``, waits for all ranks, then rank 0
renames the directory and only after that replaces ``latest`` (write + rename):
a crash at any point leaves ``latest`` naming a complete checkpoint.

What each rank writes and reads (keys of full tensors, chunks at global offsets, ZeRO
owned ranges, the tied embedding written once, vocabulary padding) is the sharded format
of :mod:`oases.runtime.ckpt_format`. Nothing is gathered: a save's extra memory is one
chunk at a time (DCP copies a view before writing it), a load's is one saved chunk.

**Async save** (:class:`AsyncSaver`, ``checkpoint.async_save=true``): DCP's
``async_save`` copies this rank's chunks to host memory (pinned on CUDA) and writes them
from a background thread over a process group of its own, so the next steps run while
the files are written. Rank 0 renames the directory and replaces ``latest`` once its
write has completed, which DCP returns only after every rank's data and the
``.metadata`` are on disk. At most one save is in flight; the next save, the end of the
run and a preemption wait for it.

The data position (a global sample counter) continues at any DP degree; the per-rank
RNG states are restored only when the world layout is the same.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

from oases.config.schema import SHAPE_KEYS
from oases.dp.ownership import ZeroOwnership
from oases.errors import CheckpointError
from oases.parallel.groups import ParallelContext
from oases.progress import io_progress
from oases.runtime.ckpt_format import (ChunkSavePlanner, cause, chunk_name, dcp_error, first_line,
                                       load_windows, param_layout, read_metadata, reader_for,
                                       state_pieces, windows_for)

__all__ = ["CheckpointException", "cause", "first_line", "read_metadata", "save", "load",
           "AsyncSaver", "full_model_state", "iter_model_tensors", "model_keys"]


# ---------------------------------------------------------------------------
# Optimizer state, paths


def ensure_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create zero Adam state, so a checkpoint can be loaded into it before any step."""
    for group in opt.param_groups:
        fused = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            if p not in opt.state or not opt.state[p]:
                opt.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32,
                                        device=p.device if fused else "cpu"),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }


def ckpt_root(out_dir: str) -> Path:
    return Path(out_dir) / "checkpoints"


def is_complete(path: Path) -> bool:
    return (path / "meta.json").is_file() and (path / ".metadata").is_file()


def latest_checkpoint(out_dir: str) -> Optional[Path]:
    """The newest complete checkpoint, or None if there is none; a ``latest`` that
    names something incomplete is an error (never silently start over)."""
    root = ckpt_root(out_dir)
    ptr = root / "latest"
    if not ptr.exists():
        return None
    name = ptr.read_text().strip()
    path = root / name
    if not is_complete(path):
        raise CheckpointError(f"checkpoint {path} named by {ptr} is partial or missing "
                              f"(no meta.json or .metadata)")
    return path


def read_meta(path: Path) -> dict:
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path} has an unreadable meta.json: {e}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise CheckpointError(f"checkpoint {path} has a meta.json without a step")
    return meta


# ---------------------------------------------------------------------------
# Save / load


@torch.no_grad()
def all_finite(model: nn.Module, ctx: ParallelContext,
               shards: Optional[ZeroOwnership] = None) -> bool:
    """Whether every parameter on every rank is finite (collective); sharded parameters
    are checked in the owned ranges, which hold them."""
    ok = torch.ones((), device=ctx.device)
    flats = shards.flats if shards is not None else []
    sharded = {id(p) for fl in flats for p in fl.params}
    held = [fl.shard for fl in flats] + [p for p in model.parameters() if id(p) not in sharded]
    for t in held:
        if not torch.isfinite(t).all():
            ok.zero_()
            break
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def _begin(out_dir: str, step: int, model: nn.Module, opt: torch.optim.Optimizer,
           ctx: ParallelContext, meta: dict, rng_state: dict,
           shards: Optional[ZeroOwnership]) -> tuple[Path, Path, Path, list, dict]:
    """The start of a save of ``step``, synchronous or not: rank 0 clears a crash's
    leftovers and makes ``tmp`` (collective); this rank's RNG state is written there.
    Returns (root, final, tmp, this rank's pieces, the meta to publish)."""
    root = ckpt_root(out_dir)
    final, tmp = root / f"step_{step:06d}", root / f"step_{step:06d}.tmp"
    if ctx.is_main:
        root.mkdir(parents=True, exist_ok=True)
        for stale in [*root.glob("*.tmp"), *root.glob("*.del")]:  # left by a crash
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
        (tmp / "rng").mkdir()
    dist.barrier()
    torch.save(rng_state, tmp / "rng" / f"rank{ctx.rank}.pt")
    pieces = state_pieces(model, opt, ctx, shards)
    return root, final, tmp, pieces, {**meta, "layout": _layout(model, ctx)}


def _layout(model: nn.Module, ctx: ParallelContext) -> dict:
    layout = param_layout(model)
    if ctx.pp > 1:  # each stage knows only its own parameters
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, layout)
        layout = {k: v for part in parts for k, v in part.items()}
    return layout


def _publish(root: Path, tmp: Path, final: Path, meta: dict, keep: int) -> None:
    """Rank 0, once every rank's files are in ``tmp``: meta.json, rename, ``latest``,
    prune."""
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    if final.exists():  # re-saving a step (e.g. after a restart): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    ptr_tmp = root / "latest.tmp"
    ptr_tmp.write_text(final.name + "\n")
    os.replace(ptr_tmp, root / "latest")
    done = sorted(p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit())
    for old in done[:-keep]:  # renamed first: a crash mid-delete leaves no partial step_N
        trash = old.with_name(old.name + ".del")
        os.replace(old, trash)
        shutil.rmtree(trash, ignore_errors=True)


def save(out_dir: str, step: int, model: nn.Module, opt: torch.optim.Optimizer,
         ctx: ParallelContext, meta: dict, rng_state: dict, keep: int = 2,
         shards: Optional[ZeroOwnership] = None) -> Path:
    """Write this rank's owned state (``shards``: the run's ZeRO ownership) as step
    ``step``'s checkpoint and publish it (collective)."""
    root, final, tmp, pieces, meta = _begin(out_dir, step, model, opt, ctx, meta, rng_state,
                                            shards)
    with io_progress(f"saving {final.name}", kind="write"):  # bytes written by this rank
        dcp.save({p.name: p.local for p in pieces}, checkpoint_id=str(tmp),
                 planner=ChunkSavePlanner(pieces))
    dist.barrier()
    if ctx.is_main:
        _publish(root, tmp, final, meta, keep)
    dist.barrier()
    return final


class AsyncSaver:
    """Saves with DCP's ``async_save``: the chunks are staged to host memory, then written
    in the background over a process group of the saver's own (the training's groups
    keep their collective order); see the module docstring."""

    def __init__(self) -> None:
        self.group = None
        self.pending: Optional[tuple[Future, object, Optional[Callable[[], None]]]] = None

    def save(self, out_dir: str, step: int, model: nn.Module, opt: torch.optim.Optimizer,
             ctx: ParallelContext, meta: dict, rng_state: dict, keep: int = 2,
             shards: Optional[ZeroOwnership] = None) -> Path:
        """Start the save of step ``step`` (collective); returns the path it will have."""
        from torch.distributed.checkpoint.staging import (  # deferred: async saves only
            DefaultStager, StagingOptions)

        self.wait()
        if self.group is None:  # every rank saves at the same steps: the same call order
            self.group = dist.new_group(backend="gloo")
        root, final, tmp, pieces, meta = _begin(out_dir, step, model, opt, ctx, meta,
                                                rng_state, shards)
        stager = DefaultStager(StagingOptions(ctx.device.type == "cuda", False, False, False))
        fut = dcp.async_save({p.name: p.local for p in pieces}, checkpoint_id=str(tmp),
                             planner=ChunkSavePlanner(pieces), process_group=self.group,
                             async_stager=stager)
        publish = (lambda: _publish(root, tmp, final, meta, keep)) if ctx.is_main else None
        self.pending = (fut, stager, publish)
        return final

    def poll(self) -> None:
        """Publish the save in flight if its write has completed (no collective)."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Wait for the save in flight and publish it (no collective)."""
        if self.pending is None:
            return
        fut, stager, publish = self.pending
        self.pending = None
        try:
            fut.result()
        finally:
            stager.close()
        if publish is not None:
            publish()


def load(path: Path, model: nn.Module, opt: Optional[torch.optim.Optimizer],
         ctx: ParallelContext, model_shape: dict, layout: Optional[dict] = None,
         shards: Optional[ZeroOwnership] = None, alone: bool = False
         ) -> tuple[dict, Optional[dict]]:
    """Load model + optimizer state (``opt`` None: the model alone) in place into what
    this rank owns (``shards``: the run's ZeRO ownership), resharding from whatever level
    and (pp, dp, tp) layout the checkpoint was written with; returns (meta, this rank's
    RNG state or None if the checkpoint was written by a different layout: the entries
    of ``layout``, default world size and tp, must all match its meta). Collective,
    unless ``alone`` (one process reading by itself)."""
    meta = read_meta(path)
    saved_shape = meta.get("model_shape", {})
    diff = [f"{k}: {saved_shape.get(k)} -> {model_shape.get(k)}" for k in SHAPE_KEYS
            if saved_shape.get(k) != model_shape.get(k)]
    if diff:
        raise CheckpointError(f"checkpoint {path} was saved for another model shape "
                              f"({'; '.join(diff)})")
    reader = reader_for(path)  # reads .metadata once, for the check and the load
    saved = read_metadata(path, reader)
    if opt is not None:
        ensure_optimizer_state(opt)
    if shards is not None:
        shards.release()  # nothing gathered, no all-gather in flight into the parameters
    pieces = state_pieces(model, opt, ctx, shards, load=True)
    with torch.no_grad():
        load_windows(path, windows_for(path, pieces, saved), reader, alone=alone)
    rng = None
    layout = layout or {"world_size": ctx.world_size, "tp": ctx.tp}
    same_layout = all(meta.get(k, 1 if k == "pp" else None) == v for k, v in layout.items())
    rng_file = path / "rng" / f"rank{ctx.rank}.pt"
    if same_layout and rng_file.is_file():
        try:
            rng = torch.load(rng_file, weights_only=False)
        except Exception as e:
            raise CheckpointError(f"checkpoint {path}: unreadable {rng_file.name} "
                                  f"({dcp_error(e)})") from None
    return meta, rng


# ---------------------------------------------------------------------------
# Full (unsharded) model tensors, one at a time, without a process group


def model_keys(path: Path, prefix: str = "model", reader=None) -> tuple[dict, dict[str, list]]:
    """(meta, parameter name -> (key, storage metadata) of its keys, parts in order) of
    the tensors of a checkpoint under ``prefix`` (``model``, ``optim.exp_avg``, ...);
    ``reader``: a :func:`reader_for` to read its metadata with (kept for the load)."""
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


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory; or a run's out_dir, or its checkpoints/ directory: the
    checkpoint ``latest`` names there."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p} does not exist")
    if (p / ".metadata").exists() or (p / "meta.json").exists():
        if not is_complete(p):
            raise CheckpointError(f"checkpoint {p} is partial (no meta.json or .metadata)")
        return p
    for out_dir in (p, p.parent):
        if (ckpt_root(str(out_dir)) / "latest").is_file() and ckpt_root(str(out_dir)) in (
                p / "checkpoints", p):
            return latest_checkpoint(str(out_dir))
    raise CheckpointError(f"{p} is neither a checkpoint nor a run directory with one")


def latest_name(out_dir: str) -> Optional[str]:
    """The checkpoint ``latest`` names (for messages), or None."""
    try:
        return str(ckpt_root(out_dir) / (ckpt_root(out_dir) / "latest").read_text().strip())
    except OSError:
        return None
