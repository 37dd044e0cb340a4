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

import math
import zlib
from dataclasses import dataclass
from typing import Optional, Sequence

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


def _full_init(name: str, shape: tuple, rule: tuple, seed: int, logical: Optional[int],
               dim: int) -> torch.Tensor:
    kind = rule[0]
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "ones":
        return torch.ones(shape)
    if kind != "normal":
        raise ValueError(f"unknown init rule {rule} for {name}")
    # One generator per parameter name: the full tensor is the same whatever the
    # TP degree, the construction order or the set of other parameters.
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    real = list(shape)
    if logical is not None:
        real[dim] = logical
    full = torch.zeros(shape)
    body = torch.empty(real).normal_(0.0, rule[1], generator=g)
    full.narrow(dim, 0, real[dim]).copy_(body)  # padded vocab rows stay zero
    return full


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, tp_rank: int, tp: int) -> None:
    """Initialise every parameter from a per-name seeded full tensor, then shard.

    Same seed -> same full weights at every TP degree (the parity tests rely on it).
    A parameter of a layer built on a sub-group (per-block degrees) records its own
    ``tp_coords = (rank, size)``, which wins over ``tp_rank``/``tp``.
    """
    for name, p in model.named_parameters():
        rule = getattr(p, "init_rule", None)
        if rule is None:
            raise ValueError(f"parameter {name} has no init rule; create it with set_spec()")
        spec = getattr(p, "tp_spec", None)
        shape = spec.full_shape if spec else tuple(p.shape)
        full = _full_init(name, shape, rule, seed, spec.logical if spec else None,
                          spec.dim if spec else 0)
        rank, size = getattr(p, "tp_coords", (tp_rank, tp))  # per-block degrees
        p.copy_(shard(full, spec, rank, size).to(p.dtype))


def divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by tp={d}")
    return n // d


def ceil_to(n: int, m: int) -> int:
    return math.ceil(n / m) * m
