"""Rank lists of the groups a layout needs, and their creation in one collective order.
Below both :mod:`oases.parallel.groups` and :mod:`oases.parallel.reshard`."""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from oases.config.heads import kv_replicas


def kv_replica_ranks(first: int, dp: int, T: int, t: int,
                     kv_heads: Optional[int]) -> list[list[int]]:
    """The kv replica groups of attention blocks at degree t on ``dp`` x ``T`` ranks from
    rank ``first`` (a stage; T = t unless a plan gives blocks their own degree): in DP
    replica d, degree-t subgroup g, the r = t / kv_heads ranks holding kv head h,

        {first + d*T + g*t + h*r + i : i < r}

    None of them when kv heads are not replicated at degree t (or ``kv_heads`` unknown)."""
    r = kv_replicas(kv_heads, t) if kv_heads else 1
    if r == 1:
        return []
    return [[first + d * T + g * t + h * r + i for i in range(r)]
            for d in range(dp) for g in range(T // t) for h in range(t // r)]


def new_groups(rank: int, rank_lists: list[list[int]]) -> Optional[dist.ProcessGroup]:
    """Create every group of ``rank_lists`` (collective: all ranks, in the same order);
    returns the one ``rank`` belongs to, if any."""
    mine = None
    for ranks in rank_lists:
        g = dist.new_group(ranks)
        if rank in ranks:
            mine = g
    return mine
