"""How a TP-sharded parameter relates to its full (unsharded) tensor.

Every parameter of a parallel layer carries ``param.tp_spec``: ``None`` for a
parameter replicated on all TP ranks, or a :class:`TPSpec`. The spec is what
initialisation, checkpoints, gradient clipping and HF import use to go
between the full tensor and this rank's shard, so none of them needs to know
the layer.

Fused layers (QKV, SwiGLU gate+up) shard each *part* separately:

    full (dim 0):  [ q (h) | k (kv) | v (kv) ]          parts = (h, kv, kv)
    rank r shard:  [ q_r   | k_r    | v_r    ]          each part chunked over tp
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


def shard(full: torch.Tensor, spec: Optional[TPSpec], rank: int, tp: int) -> torch.Tensor:
    """This rank's shard of a full tensor."""
    if spec is None or tp == 1:
        return full
    pieces = full.split(list(spec.parts), dim=spec.dim) if spec.parts else (full,)
    return torch.cat([p.chunk(tp, dim=spec.dim)[rank] for p in pieces], dim=spec.dim)


def unshard(shards: Sequence[torch.Tensor], spec: Optional[TPSpec]) -> torch.Tensor:
    """The full tensor from all ranks' shards (in TP rank order)."""
    if spec is None:
        return shards[0]
    tp = len(shards)
    if not spec.parts:
        return torch.cat(list(shards), dim=spec.dim)
    local_parts = [p // tp for p in spec.parts]
    split = [s.split(local_parts, dim=spec.dim) for s in shards]
    return torch.cat([torch.cat([split[r][i] for r in range(tp)], dim=spec.dim)
                      for i in range(len(spec.parts))], dim=spec.dim)


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
