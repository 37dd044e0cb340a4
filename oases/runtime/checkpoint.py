"""Checkpoints with ``torch.distributed.checkpoint``: each rank writes its shard.

Layout under ``<out_dir>/checkpoints``:

    step_000040/          a complete checkpoint (DCP files + meta.json + rng/)
    step_000040.tmp/      a save in progress (ignored; removed by the next save)
    step_000020.del/      an old checkpoint being pruned (ignored; removed by the next save)
    latest                the name of the newest complete checkpoint

A save writes everything into ``step_N.tmp``, waits for all ranks, then rank 0
renames the directory and only after that replaces ``latest`` (write + rename):
a crash at any point leaves ``latest`` naming a complete checkpoint.

**Keys and shards.** Every tensor is stored under a key that names a *full*
(unsharded) tensor: ``model/<param>``, ``optim.exp_avg/<param>``,
``optim.exp_avg_sq/<param>``, ``optim.step/<param>``. Fused parameters (QKV,
gate+up) are stored one key per part (``<param>.part0``, ...), so every key is a
plain tensor that a shard is a contiguous slice of. Each rank contributes its
local shard as a chunk *at its global offset* (DCP's sharded-tensor format; a
replicated tensor is one chunk at offset 0, written once). A load asks for the
slice the *current* layout needs, wherever the saved chunks lie, so a
checkpoint loads at any TP degree and any DP degree (DCP reads the overlaps).
A parameter of a block with its own TP degree (a plan) records ``tp_coords``
(its rank and group size), which place its chunk the same way. DCP checks at
save time that the chunks of every key tile it exactly.

**Vocabulary padding.** The embedding and an untied head are padded to a
multiple of ``vocab_pad_to x tp`` rows, so their full shape depends on tp. The
padded rows are zero and stay zero (their gradients are zero and so are their
Adam moments). A load therefore reads only the *logical* rows ``< vocab_size``
of this rank's shard from the saved tensor, whatever its padded size, and
zeroes the rest -- for the weights and for both Adam moments alike, with no
full-size temporary.

The data position (a global sample counter) continues at any DP degree; the
per-rank RNG states are restored only when the world layout is the same.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadPlan, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from oases.config.schema import SHAPE_KEYS
from oases.errors import CheckpointError
from oases.parallel.groups import ParallelContext
from oases.parallel.sharding import chunk_of
from oases.progress import io_progress, nbytes

_MOMENTS = ("exp_avg", "exp_avg_sq")


# ---------------------------------------------------------------------------
# Pieces: (key, local view, global offset, full shape)


@dataclass
class Piece:
    key: str                       # DCP key of the full tensor
    local: torch.Tensor            # this rank's slice (a view of the live tensor)
    offsets: tuple                 # where `local` starts in the full tensor
    full: tuple                    # full shape in the current layout (padding included)
    vocab: Optional[tuple] = None  # (dim, logical rows) for a vocabulary-padded tensor


def _param_pieces(prefix: str, name: str, t: torch.Tensor, spec, coords) -> list[Piece]:
    """Pieces of one parameter-shaped tensor ``t`` (a parameter or its Adam moment)."""
    if spec is None:
        return [Piece(f"{prefix}/{name}", t, (0,) * t.dim(), tuple(t.shape))]
    rank, size = coords
    dim = spec.dim
    if spec.parts:
        out, off = [], 0
        for i, part in enumerate(spec.parts):
            chunk, chunks = chunk_of(spec, i, rank, size)  # replicas: same chunk, saved once
            n = part // chunks
            full = list(spec.full_shape)
            full[dim] = part
            offsets = [0] * t.dim()
            offsets[dim] = chunk * n
            out.append(Piece(f"{prefix}/{name}.part{i}", t.narrow(dim, off, n), tuple(offsets),
                             tuple(full)))
            off += n
        return out
    offsets = [0] * t.dim()
    offsets[dim] = rank * t.shape[dim]
    vocab = (dim, spec.logical) if spec.logical is not None else None
    return [Piece(f"{prefix}/{name}", t, tuple(offsets), tuple(spec.full_shape), vocab)]


def _pieces(model: nn.Module, opt: Optional[torch.optim.Optimizer],
            ctx: ParallelContext) -> list[Piece]:
    """Every piece of model (and optimizer) state this rank holds, in a fixed order."""
    out: list[Piece] = []
    for name, p in model.named_parameters():
        spec = getattr(p, "tp_spec", None)
        # per-block TP degrees: a parameter records the (rank, size) of its own group
        coords = getattr(p, "tp_coords", (ctx.tp_rank, ctx.tp))
        tensors = {"model": p.data}
        st = opt.state.get(p, {}) if opt is not None else {}
        for k in _MOMENTS:
            if k in st:
                tensors[f"optim.{k}"] = st[k]
        for prefix, t in tensors.items():
            out += _param_pieces(prefix, name, t, spec, coords)
        if "step" in st:
            s = st["step"]
            out.append(Piece(f"optim.step/{name}", s, (0,) * s.dim(), tuple(s.shape)))
    return out


def param_layout(model: nn.Module) -> dict:
    """How each sharded parameter maps to its full tensor (stored in meta.json, used by
    ``python -m oases.consolidate``)."""
    layout = {}
    for name, p in model.named_parameters():
        spec = getattr(p, "tp_spec", None)
        if spec is not None:
            layout[name] = {"dim": spec.dim, "full_shape": list(spec.full_shape),
                            "parts": list(spec.parts) if spec.parts else None,
                            "logical": spec.logical}
    return layout


# ---------------------------------------------------------------------------
# DCP planners that place each local tensor at an explicit global offset


class _ChunkSavePlanner(DefaultSavePlanner):
    """Writes each piece as a chunk of its full tensor (replicated pieces: one chunk at
    offset 0, deduplicated across ranks by DCP)."""

    def __init__(self, pieces: list[Piece]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = {p.key: p for p in pieces}

    def create_local_plan(self) -> SavePlan:
        items = []
        for p in self.pieces.values():
            chunk = ChunkStorageMetadata(offsets=torch.Size(p.offsets),
                                         sizes=torch.Size(p.local.shape))
            sharded = tuple(p.local.shape) != p.full
            items.append(WriteItem(
                index=MetadataIndex(p.key, torch.Size(p.offsets)),
                type=WriteItemType.SHARD if sharded else WriteItemType.TENSOR,
                tensor_data=TensorWriteData(chunk=chunk,
                                            properties=TensorProperties.create_from_tensor(p.local),
                                            size=torch.Size(p.full))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        return self.pieces[index.fqn].local


class _WindowLoadPlanner(DefaultLoadPlanner):
    """Reads, for each key, the window ``(tensor, offsets)`` of the saved full tensor."""

    def __init__(self, windows: dict[str, tuple[torch.Tensor, tuple]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.windows = windows

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, (t, offsets) in self.windows.items():
            md = self.metadata.state_dict_metadata[key]
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(t.shape))
            items += create_read_items_for_chunk_list(key, md, [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.windows[index.fqn][0]


def read_metadata(path: Path) -> dict[str, TensorStorageMetadata]:
    """The tensors a DCP checkpoint holds: key -> storage metadata (global size, dtype)."""
    try:
        md = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # missing, truncated or not a pickle
        raise CheckpointError(f"checkpoint {path} has an unreadable .metadata "
                              f"({type(e).__name__}: {first_line(e)})") from None
    return {k: v for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def first_line(e: BaseException, limit: Optional[int] = 160) -> str:
    """The first non-empty line of ``e``'s message (its type's name if it has none),
    cut at ``limit`` characters (None: whole)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    line = lines[0] if lines else type(e).__name__
    return line if limit is None or len(line) <= limit else line[:limit].rstrip() + "..."


def cause(e: BaseException) -> BaseException:
    """What went wrong inside a DCP failure: a CheckpointException wraps each rank's
    exception (``failures``: rank -> exception or (exception, traceback)); the first
    that is not itself a wrapper, else ``e``."""
    if not isinstance(e, CheckpointException):
        return e
    for v in (getattr(e, "failures", None) or {}).values():
        exc = v[0] if isinstance(v, tuple) else v
        if not isinstance(exc, CheckpointException):
            return exc
    return e


def _dcp_error(e: BaseException) -> str:
    """One line for a DCP failure."""
    exc = cause(e)
    return f"{type(exc).__name__}: {first_line(exc)}"


def load_windows(path: Path, windows: dict[str, tuple[torch.Tensor, tuple]]) -> None:
    """Fill each ``tensor`` of ``windows`` (key -> (tensor, global offsets)) from the
    checkpoint. Collective when a process group is up (every rank calls it); works
    without one (a single process)."""
    try:
        with io_progress(f"loading {path.name}", nbytes(t for t, _ in windows.values()), "read"):
            dcp.load({k: t for k, (t, _) in windows.items()}, checkpoint_id=str(path),
                     planner=_WindowLoadPlanner(windows))
    except (Exception, CheckpointException) as e:
        failures = getattr(e, "failures", None) or {}
        causes = [v[0] if isinstance(v, tuple) else v for v in failures.values()] or [e]
        if any(isinstance(c, dist.DistError) for c in causes):
            raise  # a peer died or hung while loading: not the checkpoint's fault
        raise CheckpointError(f"checkpoint {path} could not be loaded ({_dcp_error(e)})") from None


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
def all_finite(model: nn.Module, ctx: ParallelContext) -> bool:
    """Whether every parameter on every rank is finite (collective)."""
    ok = torch.ones((), device=ctx.device)
    for p in model.parameters():
        if not torch.isfinite(p).all():
            ok.zero_()
            break
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def save(out_dir: str, step: int, model: nn.Module, opt: torch.optim.Optimizer,
         ctx: ParallelContext, meta: dict, rng_state: dict, keep: int = 2) -> Path:
    root = ckpt_root(out_dir)
    name = f"step_{step:06d}"
    final, tmp = root / name, root / f"{name}.tmp"
    if ctx.is_main:
        root.mkdir(parents=True, exist_ok=True)
        for stale in [*root.glob("*.tmp"), *root.glob("*.del")]:  # left by a crash
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
        (tmp / "rng").mkdir()
    dist.barrier()
    pieces = _pieces(model, opt, ctx)
    with io_progress(f"saving {name}", kind="write"):  # bytes written by this rank
        dcp.save({p.key: p.local for p in pieces}, checkpoint_id=str(tmp),
                 planner=_ChunkSavePlanner(pieces))
    torch.save(rng_state, tmp / "rng" / f"rank{ctx.rank}.pt")
    layout = param_layout(model)
    if ctx.pp > 1:  # each stage knows only its own parameters
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, layout)
        layout = {k: v for part in parts for k, v in part.items()}
    dist.barrier()
    if ctx.is_main:
        meta = {**meta, "layout": layout}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if final.exists():  # re-saving a step (e.g. after a restart): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        ptr_tmp = root / "latest.tmp"
        ptr_tmp.write_text(name + "\n")
        os.replace(ptr_tmp, root / "latest")
        done = sorted(p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit())
        for old in done[:-keep]:  # renamed first: a crash mid-delete leaves no partial step_N
            trash = old.with_name(old.name + ".del")
            os.replace(old, trash)
            shutil.rmtree(trash, ignore_errors=True)
    dist.barrier()
    return final


def _windows(path: Path, pieces: list[Piece], saved: dict) -> dict:
    """Check every piece against the saved tensors and return the windows to read;
    zeroes the vocabulary padding rows that will not be read."""
    missing, wrong = [], []
    windows = {}
    for p in pieces:
        md = saved.get(p.key)
        if md is None:
            missing.append(p.key)
            continue
        size = tuple(md.size)
        if p.vocab is None:
            if size != p.full:
                wrong.append(f"{p.key}: saved {list(size)}, model {list(p.full)}")
                continue
            windows[p.key] = (p.local, p.offsets)
            continue
        dim, logical = p.vocab
        other_ok = all(size[d] == p.full[d] for d in range(len(size)) if d != dim)
        if len(size) != len(p.full) or not other_ok or size[dim] < logical:
            wrong.append(f"{p.key}: saved {list(size)}, model {list(p.full)} "
                         f"({logical} real rows)")
            continue
        # this rank's rows [start, start + n) of the padded table; real ones come from disk
        start, n = p.offsets[dim], p.local.shape[dim]
        real = max(0, min(n, logical - start))
        if real < n:
            p.local.narrow(dim, real, n - real).zero_()
        if real > 0:
            windows[p.key] = (p.local.narrow(dim, 0, real), p.offsets)
    if missing or wrong:
        what = "; ".join(wrong[:3] + [f"no {k}" for k in missing[:3]])
        more = len(missing) + len(wrong) - min(len(wrong), 3) - min(len(missing), 3)
        raise CheckpointError(f"checkpoint {path} does not match the model ({what}"
                              f"{f'; {more} more' if more > 0 else ''})")
    return windows


def load(path: Path, model: nn.Module, opt: torch.optim.Optimizer, ctx: ParallelContext,
         model_shape: dict, layout: Optional[dict] = None) -> tuple[dict, Optional[dict]]:
    """Load model + optimizer state in place, resharding from whatever (pp, dp, tp)
    layout the checkpoint was written with (every rank reads the pieces of the
    parameters it holds: a pipeline stage, its layers'); returns (meta, this rank's RNG
    state or None if the checkpoint was written by a different layout: the entries of
    ``layout``, default world size and tp, must all match its meta)."""
    meta = read_meta(path)
    saved_shape = meta.get("model_shape", {})
    diff = [f"{k}: {saved_shape.get(k)} -> {model_shape.get(k)}" for k in SHAPE_KEYS
            if saved_shape.get(k) != model_shape.get(k)]
    if diff:
        raise CheckpointError(f"checkpoint {path} was saved for another model shape "
                              f"({'; '.join(diff)})")
    saved = read_metadata(path)
    ensure_optimizer_state(opt)
    pieces = _pieces(model, opt, ctx)
    with torch.no_grad():
        windows = _windows(path, pieces, saved)
        load_windows(path, windows)
    rng = None
    layout = layout or {"world_size": ctx.world_size, "tp": ctx.tp}
    same_layout = all(meta.get(k, 1 if k == "pp" else None) == v for k, v in layout.items())
    rng_file = path / "rng" / f"rank{ctx.rank}.pt"
    if same_layout and rng_file.is_file():
        try:
            rng = torch.load(rng_file, weights_only=False)
        except Exception as e:
            raise CheckpointError(f"checkpoint {path}: unreadable {rng_file.name} "
                                  f"({_dcp_error(e)})") from None
    return meta, rng


# ---------------------------------------------------------------------------
# Full (unsharded) model tensors, without a process group


def full_model_state(path: Path) -> dict[str, torch.Tensor]:
    """The model's full tensors from a checkpoint: fused parts reassembled, vocabulary
    padding removed, keyed by parameter name. Needs no process group."""
    meta = read_meta(path)
    saved = read_metadata(path)
    layout = meta.get("layout") or {}
    vocab = (meta.get("model_shape") or {}).get("vocab_size")
    windows = {k: (torch.empty(tuple(md.size), dtype=md.properties.dtype), (0,) * len(md.size))
               for k, md in saved.items() if k.startswith("model/")}
    if not windows:
        raise CheckpointError(f"checkpoint {path} holds no model tensors")
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": intended
        warnings.simplefilter("ignore", UserWarning)
        load_windows(path, windows)
    parts: dict[str, dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, (t, _) in windows.items():
        name = key[len("model/"):]
        base, _, idx = name.rpartition(".part")
        if base and idx.isdigit():
            parts.setdefault(base, {})[int(idx)] = t
        else:
            out[name] = t
    for base, ps in parts.items():
        dim = (layout.get(base) or {}).get("dim", 0)  # fused projections: output rows
        out[base] = torch.cat([ps[i] for i in sorted(ps)], dim=dim)
    for name, t in out.items():
        info = layout.get(name)
        if info is not None:
            logical, dim = info.get("logical"), info.get("dim", 0)
        elif name in ("embed.wte.weight", "head.weight") and vocab:  # a checkpoint without layout
            logical, dim = vocab, 0
        else:
            continue
        if logical is not None and t.shape[dim] > logical:
            out[name] = t.narrow(dim, 0, logical).clone()
    return {k: out[k] for k in sorted(out)}


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


def num_elements(state: dict[str, torch.Tensor]) -> int:
    return sum(math.prod(t.shape) for t in state.values())


def latest_name(out_dir: str) -> Optional[str]:
    """The checkpoint ``latest`` names (for messages), or None."""
    try:
        return str(ckpt_root(out_dir) / (ckpt_root(out_dir) / "latest").read_text().strip())
    except OSError:
        return None
