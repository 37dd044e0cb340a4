"""The sharded checkpoint format: what each rank writes and reads, as DCP chunks.

**Keys.** Every tensor is stored under a key that names a *full* (unsharded) tensor:
``model/<param>``, ``optim.exp_avg/<param>``, ``optim.exp_avg_sq/<param>``,
``optim.step/<param>``. Fused parameters (QKV, gate+up) are stored one key per part
(``<param>.part0``, ...), so every key is a plain tensor.

**Chunks.** A rank writes what it owns, each piece as a DCP chunk *at its global offset*
in the full tensor (DCP's sharded-tensor format):

    TP shard of a level-0 parameter    the local shard, one chunk per part
    ZeRO bucket range (levels 1-3)     the owned range [lo, hi) of the flat bucket
                                       cut at parameter boundaries; each parameter's
                                       flat run [a, b) is cut into boxes of its shape

    parameter (4, 6) at flat offset o, owned run [o + 9, o + 22):
        row 1, cols 3-5    (one partial row)
        rows 2-2           (whole rows)
        row 3, cols 0-3    (one partial row)

so a chunk is a strided view of the owned flat buffer (parameters at level 3, both Adam
moments at levels 1-3) and nothing is gathered: the largest extra buffer is DCP's copy
of one chunk. Replicated pieces (a level-0 parameter on every DP rank, GQA kv rows on
several TP ranks) are identical chunks that DCP writes once. The last pipeline stage's
copy of a tied embedding (``shared_copy``) is not written: the first stage's copy is the
same table, and the two may be sharded over different tp. DCP checks at save time that
the chunks of every key tile it exactly.

**Loading** asks, for each piece the *current* layout owns, for its window of the saved
full tensor, wherever the saved chunks lie; DCP reads the overlaps straight into the
owned buffers. So a checkpoint loads at any level, dp, tp, pp and stage layout. Levels
1 and 2 hold whole parameters and read them whole; level 3 reads its owned range.

**Vocabulary padding.** The embedding and an untied head are padded to a multiple of
``vocab_pad_to x tp`` rows, so their full shape depends on tp. The padded rows are zero
and stay zero (so are their gradients and Adam moments). A load reads only the
*logical* rows ``< vocab_size`` of each piece, whatever the saved padded size, and
zeroes the rest.
"""

from __future__ import annotations

import contextlib
import math
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

from oases.dp.ownership import ZeroOwnership
from oases.errors import CheckpointError, first_line
from oases.parallel.groups import ParallelContext
from oases.parallel.sharding import chunk_of
from oases.progress import io_progress, nbytes

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class Piece:
    key: str                       # DCP key of the full tensor
    local: torch.Tensor            # this rank's chunk: a view of the live (owned) storage
    offsets: tuple                 # where `local` starts in the full tensor
    full: tuple                    # full shape in the current layout (padding included)
    vocab: Optional[tuple] = None  # (dim, logical rows) for a vocabulary-padded tensor

    @property
    def name(self) -> str:
        """The state-dict name of this chunk (a key may have several chunks per rank)."""
        return chunk_name(self.key, self.offsets)


def chunk_name(key: str, offsets) -> str:
    return f"{key}@{','.join(str(int(o)) for o in offsets)}"


@dataclass
class _Region:
    """Where one key's chunk lies in a parameter's local (TP-shard) tensor."""
    key: str
    start: tuple     # local start
    size: tuple      # local size
    offsets: tuple   # global offset of `start` in the key's full tensor
    full: tuple
    vocab: Optional[tuple] = None


def _regions(name: str, shape: tuple, spec, coords) -> list[_Region]:
    """The keys of one parameter-shaped tensor (a parameter or its Adam moment) and where
    each lies in the local tensor of ``shape``."""
    zeros = (0,) * len(shape)
    if spec is None:
        return [_Region(name, zeros, shape, zeros, shape)]
    rank, size = coords
    dim = spec.dim
    if not spec.parts:
        offsets = list(zeros)
        offsets[dim] = rank * shape[dim]
        vocab = (dim, spec.logical) if spec.logical is not None else None
        return [_Region(name, zeros, shape, tuple(offsets), tuple(spec.full_shape), vocab)]
    out, off = [], 0
    for i, part in enumerate(spec.parts):
        chunk, chunks = chunk_of(spec, i, rank, size)  # replicas: the same chunk, saved once
        n = part // chunks
        start, sz, offsets, full = list(zeros), list(shape), list(zeros), list(spec.full_shape)
        start[dim], sz[dim], offsets[dim], full[dim] = off, n, chunk * n, part
        out.append(_Region(f"{name}.part{i}", tuple(start), tuple(sz), tuple(offsets),
                           tuple(full)))
        off += n
    return out


def flat_boxes(shape: tuple, x: int, y: int) -> list[tuple[tuple, tuple]]:
    """The flat run ``[x, y)`` of a row-major tensor of ``shape`` as boxes (start, size):
    a partial leading row, whole rows, a partial trailing row, recursively."""
    if x >= y:
        return []
    if len(shape) <= 1:
        return [((x,), (y - x,))]
    inner = math.prod(shape[1:])
    r0, r1 = x // inner, (y - 1) // inner
    out: list[tuple[tuple, tuple]] = []
    if r0 == r1:
        return [((r0, *s), (1, *z)) for s, z in flat_boxes(shape[1:], x - r0 * inner,
                                                            y - r0 * inner)]
    if x % inner:  # the partial first row
        out += [((r0, *s), (1, *z)) for s, z in flat_boxes(shape[1:], x % inner, inner)]
        r0 += 1
    whole_end = r1 + 1 if y % inner == 0 else r1
    if whole_end > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (whole_end - r0, *shape[1:])))
    if y % inner:
        out += [((r1, *s), (1, *z)) for s, z in flat_boxes(shape[1:], 0, y % inner)]
    return out


def _strides(shape: tuple) -> tuple:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _cut(prefix: str, regions: list[_Region], boxes, view_of) -> list[Piece]:
    """Pieces of the intersections of ``boxes`` (local start, size) with the regions;
    ``view_of(start, size)`` is the live view of a local box."""
    out = []
    for bs, bz in boxes:
        for r in regions:
            lo = [max(a, b) for a, b in zip(bs, r.start)]
            hi = [min(a + m, b + n) for a, m, b, n in zip(bs, bz, r.start, r.size)]
            if any(h <= q for q, h in zip(lo, hi)):
                continue
            size = tuple(h - q for q, h in zip(lo, hi))
            offsets = tuple(o + q - s for o, q, s in zip(r.offsets, lo, r.start))
            out.append(Piece(f"{prefix}/{r.key}", view_of(tuple(lo), size), offsets, r.full,
                             r.vocab))
    return out


def _whole(prefix: str, t: torch.Tensor, regions: list[_Region]) -> list[Piece]:
    def view(start, size):
        v = t
        for d, (s, n) in enumerate(zip(start, size)):
            v = v.narrow(d, s, n)
        return v
    return _cut(prefix, regions, [((0,) * t.dim(), tuple(t.shape))], view)


def _owned(prefix: str, buf: torch.Tensor, lo: int, o: int, shape: tuple, a: int, b: int,
           regions: list[_Region]) -> list[Piece]:
    """Pieces of the run ``[a, b)`` of a flat bucket (``buf`` holds its owned range,
    starting at bucket position ``lo``) of the parameter at bucket position ``o``."""
    strides = _strides(shape)
    base = buf.storage_offset() + o - lo

    def view(start, size):
        return buf.as_strided(size, strides, base + sum(s * k for s, k in zip(start, strides)))
    return _cut(prefix, regions, flat_boxes(shape, a - o, b - o), view)


def _step_piece(name: str, st: Optional[dict]) -> list[Piece]:
    if not st or "step" not in st:
        return []
    s = st["step"]
    return [Piece(f"optim.step/{name}", s, (0,) * s.dim(), tuple(s.shape))]


def state_pieces(model: nn.Module, opt: Optional[torch.optim.Optimizer], ctx: ParallelContext,
                 shards: Optional[ZeroOwnership] = None, load: bool = False) -> list[Piece]:
    """Every piece of model (and optimizer) state this rank owns, in a fixed order: the
    chunks it writes (``load`` False), or the windows it reads (True)."""
    flats = shards.flats if shards is not None else []
    flat_of = {id(p): (fl, o) for fl in flats for p, o in zip(fl.params, fl.offsets)}
    seg_of = {id(p): seg for fl in flats for seg, p in fl.segments}
    # bf16 compute weights: a level-0 parameter's fp32 master is what is written and read
    master_of = shards.master_of() if shards is not None else {}
    out: list[Piece] = []
    for name, p in model.named_parameters():
        if getattr(p, "shared_copy", False) and not load:
            continue  # the first stage writes the tied table
        # per-block TP degrees: a parameter records the (rank, size) of its own group
        regions = _regions(name, tuple(p.shape), getattr(p, "tp_spec", None),
                           getattr(p, "tp_coords", (ctx.tp_rank, ctx.tp)))
        z = flat_of.get(id(p))
        if z is None:  # level 0: the whole local shard
            m = master_of.get(id(p))
            out += _whole("model", p.data if m is None else m, regions)
            st = opt.state.get(p if m is None else m, {}) if opt is not None else {}
            out += [q for k in MOMENTS if k in st for q in _whole(f"optim.{k}", st[k], regions)]
            out += _step_piece(name, st)
            continue
        fl, o = z
        a, b = max(o, fl.lo), min(o + p.numel(), fl.hi)
        if load and fl.level < 3 and not fl.master:  # whole parameters: read them whole
            out += _whole("model", p.data, regions)
        else:
            out += _owned("model", fl.shard, fl.lo, o, tuple(p.shape), a, b, regions)
        if opt is None or a >= b:
            continue
        for k in MOMENTS:
            out += _owned(f"optim.{k}", getattr(fl, k), fl.lo, o, tuple(p.shape), a, b,
                          regions)
        out += _step_piece(name, opt.state.get(seg_of[id(p)]))
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
# DCP planners that place each local chunk at an explicit global offset


class ChunkSavePlanner(DefaultSavePlanner):
    """Writes each piece as a chunk of its full tensor (replicated pieces: one chunk at
    the same offset on several ranks, written once by DCP). The state dict it saves maps
    :attr:`Piece.name` to the chunk (the live view, or DCP's staged copy of it)."""

    def __init__(self, pieces: list[Piece]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = pieces

    def create_local_plan(self) -> SavePlan:
        items = []
        for p in self.pieces:
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
        return self.state_dict[chunk_name(index.fqn, index.offset)]


class WindowLoadPlanner(DefaultLoadPlanner):
    """Reads, for each window ``name -> (tensor, key, offsets)``, that window of the saved
    full tensor ``key``."""

    def __init__(self, windows: dict[str, tuple[torch.Tensor, str, tuple]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.windows = windows

    def create_local_plan(self) -> LoadPlan:
        by_key: dict[str, list[ChunkStorageMetadata]] = {}
        for t, key, offsets in self.windows.values():
            by_key.setdefault(key, []).append(ChunkStorageMetadata(
                offsets=torch.Size(offsets), sizes=torch.Size(t.shape)))
        items = []
        for key, chunks in by_key.items():
            items += create_read_items_for_chunk_list(
                key, self.metadata.state_dict_metadata[key], chunks)
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.windows[chunk_name(index.fqn, index.offset)][0]


# ---------------------------------------------------------------------------
# Reading


def read_metadata(path: Path, reader: Optional[FileSystemReader] = None
                  ) -> dict[str, TensorStorageMetadata]:
    """The tensors a DCP checkpoint holds: key -> storage metadata (global size, dtype).
    ``reader``: the :func:`reader_for` that will also load them (it keeps what it read)."""
    try:
        md = (reader or FileSystemReader(str(path))).read_metadata()
    except Exception as e:  # missing, truncated or not a pickle
        raise CheckpointError(f"checkpoint {path} has an unreadable .metadata "
                              f"({type(e).__name__}: {first_line(e)})") from None
    return {k: v for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


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


def dcp_error(e: BaseException) -> str:
    """One line for a DCP failure."""
    exc = cause(e)
    return f"{type(exc).__name__}: {first_line(exc)}"


class _Reader(FileSystemReader):
    """A reader that reads ``.metadata`` once (streaming reads call DCP once per tensor)."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self._md = None

    def read_metadata(self, *args, **kwargs):
        if self._md is None:
            self._md = super().read_metadata(*args, **kwargs)
        return self._md


def load_windows(path: Path, windows: dict[str, tuple[torch.Tensor, str, tuple]],
                 reader: Optional[FileSystemReader] = None, alone: bool = False) -> None:
    """Fill each ``tensor`` of ``windows`` (name -> (tensor, key, global offsets)) from the
    checkpoint. Collective when a process group is up (every rank calls it), unless
    ``alone`` (this process reads by itself, quietly: streaming)."""
    try:
        shown = io_progress(f"loading {path.name}", nbytes(t for t, _, _ in windows.values()),
                            "read") if not alone else contextlib.nullcontext()
        with shown:
            dcp.load({k: t for k, (t, _, _) in windows.items()},
                     storage_reader=reader or FileSystemReader(str(path)),
                     planner=WindowLoadPlanner(windows), no_dist=alone)
    except (Exception, CheckpointException) as e:
        failures = getattr(e, "failures", None) or {}
        causes = [v[0] if isinstance(v, tuple) else v for v in failures.values()] or [e]
        if any(isinstance(c, dist.DistError) for c in causes):
            raise  # a peer died or hung while loading: not the checkpoint's fault
        raise CheckpointError(f"checkpoint {path} could not be loaded ({dcp_error(e)})") from None


def reader_for(path: Path) -> FileSystemReader:
    return _Reader(path)


def windows_for(path: Path, pieces: list[Piece], saved: dict) -> dict:
    """Check every piece against the saved tensors and return the windows to read;
    zeroes the vocabulary padding rows that will not be read."""
    missing, wrong = [], []
    windows = {}
    for p in pieces:
        md = saved.get(p.key)
        if md is None:
            if p.key not in missing:
                missing.append(p.key)
            continue
        size = tuple(md.size)
        if p.vocab is None:
            if size != p.full:
                wrong.append(f"{p.key}: saved {list(size)}, model {list(p.full)}")
                continue
            windows[p.name] = (p.local, p.key, p.offsets)
            continue
        dim, logical = p.vocab
        other_ok = all(size[d] == p.full[d] for d in range(len(size)) if d != dim)
        if len(size) != len(p.full) or not other_ok or size[dim] < logical:
            wrong.append(f"{p.key}: saved {list(size)}, model {list(p.full)} "
                         f"({logical} real rows)")
            continue
        # this piece's rows [start, start + n) of the padded table; real ones come from disk
        start, n = p.offsets[dim], p.local.shape[dim]
        real = max(0, min(n, logical - start))
        if real < n:
            p.local.narrow(dim, real, n - real).zero_()
        if real > 0:
            windows[p.name] = (p.local.narrow(dim, 0, real), p.key, p.offsets)
    wrong = list(dict.fromkeys(wrong))
    if missing or wrong:
        what = "; ".join(wrong[:3] + [f"no {k}" for k in missing[:3]])
        more = len(missing) + len(wrong) - min(len(wrong), 3) - min(len(missing), 3)
        raise CheckpointError(f"checkpoint {path} does not match the model ({what}"
                              f"{f'; {more} more' if more > 0 else ''})")
    return windows
