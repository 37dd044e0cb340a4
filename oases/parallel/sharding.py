"""How a TP-sharded parameter relates to its full (unsharded) tensor.

Every parameter of a parallel layer carries ``param.tp_spec``: ``None`` for a
parameter replicated on all TP ranks, or a :class:`TPSpec`. The spec is what
initialisation, checkpoints, gradient clipping and HF import use to go
between the full tensor and this rank's shard, so none of them needs to know
the layer.

Fused layers (QKV, SwiGLU gate+up) shard each *part* separately:

    full (dim 0):  [ q (h) | k (kv) | v (kv) ]          parts = (h, kv, kv)
    rank r shard:  [ q_r   | k_r    | v_r    ]          each part chunked over tp

A part may say how many indivisible *units* (attention heads) it holds. Over more
ranks than units it is not split further but replicated: its ``units`` chunks go
to ranks in blocks of ``tp / units`` (GQA kv heads above ``n_kv_heads`` ranks,
oases.config.heads). :func:`chunk_of` is the one rule everything (init, checkpoints, HF
import, gradient norms) uses for "which chunk of part i does rank r hold":

    parts (q 4 heads, k 2, v 2), tp 4:   rank 0: [q0 | k0 | v0]   rank 1: [q1 | k0 | v0]
                                         rank 2: [q2 | k1 | v1]   rank 3: [q3 | k1 | v1]
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn as nn


@dataclass(frozen=True)
class TPSpec:
    dim: int                           # the sharded dimension
    full_shape: tuple                  # shape of the full tensor (vocab padding included)
    parts: Optional[tuple] = None      # sizes along `dim` of fused parts, each sharded alone
    logical: Optional[int] = None      # rows along `dim` that hold real entries (vocab padding)
    units: Optional[tuple] = None      # per part: indivisible units (heads), see chunk_of


def chunk_of(spec: TPSpec, i: int, rank: int, size: int) -> tuple[int, int]:
    """(chunk, chunks): part ``i`` of ``spec`` (the whole tensor if it has no parts) is
    cut into ``chunks`` equal chunks along ``spec.dim`` over a group of ``size`` ranks,
    and ``rank`` holds chunk ``chunk``. That is (rank, size), unless the part has fewer
    units than ranks: then it is cut into its units, each held by ``size / units``
    consecutive ranks (replicas)."""
    u = spec.units[i] if spec.units else None
    if u is None or size <= u:
        return rank, size
    return rank // (size // u), u


def local_parts(spec: TPSpec, size: int) -> list[int]:
    """Sizes along ``spec.dim`` of this rank's slice of each part (all parts: the
    whole tensor as one part)."""
    parts = spec.parts or (spec.full_shape[spec.dim],)
    return [p // chunk_of(spec, i, 0, size)[1] for i, p in enumerate(parts)]


def part_views(t: torch.Tensor, spec: Optional[TPSpec],
               size: int) -> list[tuple[torch.Tensor, int]]:
    """This rank's slice of each part of a local tensor ``t`` (a shard, or its gradient)
    as (view, replicas): on how many ranks of the group that same slice lives."""
    if spec is None:
        return [(t, size)]
    views = t.split(local_parts(spec, size), dim=spec.dim)
    return [(v, size // chunk_of(spec, i, 0, size)[1]) for i, v in enumerate(views)]


def shard(full: torch.Tensor, spec: Optional[TPSpec], rank: int, tp: int) -> torch.Tensor:
    """This rank's shard of a full tensor."""
    if spec is None or tp == 1:
        return full
    pieces = full.split(list(spec.parts), dim=spec.dim) if spec.parts else (full,)
    out = []
    for i, p in enumerate(pieces):
        c, n = chunk_of(spec, i, rank, tp)
        out.append(p.chunk(n, dim=spec.dim)[c])
    return torch.cat(out, dim=spec.dim)


def unshard(shards: Sequence[torch.Tensor], spec: Optional[TPSpec]) -> torch.Tensor:
    """The full tensor from all ranks' shards (in TP rank order); a replicated chunk
    is taken from the first rank that holds it."""
    if spec is None:
        return shards[0]
    tp = len(shards)
    if not spec.parts:
        return torch.cat(list(shards), dim=spec.dim)
    split = [s.split(local_parts(spec, tp), dim=spec.dim) for s in shards]
    out = []
    for i in range(len(spec.parts)):
        chunks: dict[int, torch.Tensor] = {}
        for r in range(tp):
            chunks.setdefault(chunk_of(spec, i, r, tp)[0], split[r][i])
        out.append(torch.cat([chunks[c] for c in sorted(chunks)], dim=spec.dim))
    return torch.cat(out, dim=spec.dim)


def set_spec(param: nn.Parameter, spec: Optional[TPSpec], init: tuple) -> nn.Parameter:
    """Attach the sharding spec and the init rule, ``("normal", std)`` / ``("zeros",)`` /
    ``("ones",)``, to a parameter."""
    param.tp_spec = spec
    param.init_rule = init
    return param


# Initialisation: every normal-initialised parameter is a stack of *slices* along its
# sharded dimension (dim 0 when it is not sharded): the rows of a column-parallel
# weight, the columns of a row-parallel one. Slice g of parameter `name` holds the
# standard normals of its own generator, seeded from a hash of (seed, name, g), times
# the rule's std:
#
#     full tensor (dim 0):   slice 0: SFC64(blake2b("seed/name/0"))
#                            slice 1: SFC64(blake2b("seed/name/1"))  ...
#     rank r's shard:        its own slices only, drawn where they land (chunk_of)
#
# A rank draws only what it holds, in place, and a slice's values depend on (seed,
# name, g) alone: the full tensor is the same at any tp, per-block degree, pipeline
# stage or construction order, and no rank materialises another rank's part. Each
# slice's generator starts from 192 hashed bits (torch's CPU generator keeps 32 bits
# of a seed: one per slice would repeat slices of a large model). The draws are
# numpy's (SFC64, float32 ziggurat), on the host, so a CUDA run starts from the weights
# of a CPU one. Cost: ~12 ns per value drawn (torch's normal_ is ~4, but the former
# full-tensor scheme drew tp times as many values and built two full-size temporaries
# per parameter): GPT d 2048 x 24 layers on one thread here, 16.6 s at tp 1 (was
# 14.2 s), 8.3 s per rank at tp 2 (was 14.2 s), and the transient memory of a
# 16-slice buffer instead of two copies of the largest full parameter.


def local_slices(spec: Optional[TPSpec], rank: int, size: int, n: int) -> list[range]:
    """Indices, in the full tensor along ``spec.dim``, of this rank's slices in local
    order (one range per part); ``n``: the local size along it (no spec: everything)."""
    if spec is None:
        return [range(n)]
    out, off = [], 0
    for i, p in enumerate(spec.parts or (spec.full_shape[spec.dim],)):
        c, k = chunk_of(spec, i, rank, size)
        out.append(range(off + c * (p // k), off + (c + 1) * (p // k)))
        off += p
    return out


class _SliceNormals:
    """The standard normals of parameter ``name``'s slices (above), one slice at a time;
    slices from ``logical`` on (padded vocab rows) are zeros."""

    def __init__(self, seed: int, name: str, logical: Optional[int]) -> None:
        self.bits = np.random.SFC64(0)  # its state is set for each slice
        self.normal = np.random.Generator(self.bits)
        self.state = self.bits.state
        self.words = self.state["state"]["state"]  # a, b, c, counter
        self.prefix = f"{seed}/{name}/".encode()
        self.logical = logical

    def fill(self, g: int, out: np.ndarray) -> None:
        """Slice ``g`` into ``out`` (a contiguous float32 array)."""
        if self.logical is not None and g >= self.logical:
            out[...] = 0.0
            return
        digest = hashlib.blake2b(self.prefix + str(g).encode(), digest_size=24).digest()
        self.words[:3] = np.frombuffer(digest, dtype="<u8")
        self.words[3] = 1
        self.bits.state = self.state
        self.bits.random_raw(12)  # mixed before use, as SFC64's own seeding does
        self.normal.standard_normal(out=out, dtype=np.float32)


_BLOCK = 16  # slices per transposing copy: small enough to stay in cache (3.5x faster here)


def _init_normal(p: torch.Tensor, name: str, std: float, seed: int, spec: Optional[TPSpec],
                 rank: int, size: int) -> None:
    dim = spec.dim if spec is not None else 0
    view = p.detach().reshape(1) if p.dim() == 0 else p.detach().movedim(dim, 0)
    slices = [g for r in local_slices(spec, rank, size, len(view)) for g in r]
    if len(slices) != len(view):
        raise ValueError(f"{name}: {len(view)} entries along dim {dim} here, but rank {rank} "
                         f"of {size} holds {len(slices)} of its full shape {spec.full_shape}")
    src = _SliceNormals(seed, name, spec.logical if spec is not None else None)
    if view.device.type == "cpu" and view.dtype == torch.float32 and view.is_contiguous():
        rows = view.numpy().reshape(len(view), -1)  # the slices are rows: drawn in place
        for j, g in enumerate(slices):
            src.fill(g, rows[j])
        view.mul_(std)
        return
    # sharded along a later dim (a row-parallel weight's columns), another dtype or
    # device: through a buffer of a few slices
    buf = torch.empty((_BLOCK, *view.shape[1:]), dtype=torch.float32)
    rows = buf.numpy().reshape(_BLOCK, -1)
    for j in range(0, len(slices), _BLOCK):
        k = min(_BLOCK, len(slices) - j)
        for i in range(k):
            src.fill(slices[j + i], rows[i])
        view[j:j + k].copy_(buf[:k].mul_(std))


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, tp_rank: int, tp: int) -> None:
    """Initialise every parameter by its rule, drawing only this rank's shard (above).

    Same seed -> same full weights at every TP degree (the parity tests rely on it).
    A parameter of a layer built on a sub-group (per-block degrees) records its own
    ``tp_coords = (rank, size)``, which wins over ``tp_rank``/``tp``.
    """
    for name, p in model.named_parameters():
        rule = getattr(p, "init_rule", None)
        if rule is None:
            raise ValueError(f"parameter {name} has no init rule; create it with set_spec()")
        if rule[0] == "zeros":
            p.zero_()
        elif rule[0] == "ones":
            p.fill_(1.0)
        elif rule[0] == "normal":
            rank, size = getattr(p, "tp_coords", (tp_rank, tp))  # per-block degrees
            _init_normal(p, name, rule[1], seed, getattr(p, "tp_spec", None), rank, size)
        else:
            raise ValueError(f"unknown init rule {rule} for {name}")


def divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by tp={d}")
    return n // d


def ceil_to(n: int, m: int) -> int:
    return math.ceil(n / m) * m
