"""Rank lists of the groups a layout needs, their creation in one collective order, and
the bookkeeping that lets a throwaway build destroy what it created. Below both
:mod:`oases.parallel.groups` and :mod:`oases.parallel.reshard`.

A group made with ``timeout=None`` gets torch's default (30 min on gloo, 10 min on NCCL),
not the world's ``parallel.timeout_s``: :func:`new_group` and :func:`recording_groups`
give every group the world's, so that a hung peer times out alike on every group.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Iterator, Optional

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

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
        g = new_group(ranks)
        if rank in ranks:
            mine = g
    return mine


def new_group(ranks: list[int], pg_options=None) -> dist.ProcessGroup:
    """``dist.new_group`` with the world's timeout (collective, as ``new_group`` is).
    ``pg_options`` (NCCL's Options) carries the same timeout: torch refuses two."""
    timeout = world_timeout()
    if pg_options is not None and timeout is not None:
        pg_options._timeout = timeout
    return dist.new_group(ranks, timeout=timeout, pg_options=pg_options)


def world_timeout() -> Optional[datetime.timedelta]:
    """The default group's collective timeout (``init_process_group``'s), or None when
    its backend does not say."""
    pg = c10d._get_default_group()
    for dev in pg._device_types:
        opts = getattr(pg._get_backend(dev), "options", None)
        if opts is not None:
            return opts._timeout
    return None


def live_groups() -> list[dist.ProcessGroup]:
    """The groups this rank belongs to, the default one included, in creation order
    (a non-member's ``new_group`` records nothing)."""
    return list(c10d._world.pg_map)


@contextlib.contextmanager
def recording_groups(into: list) -> Iterator[list]:
    """Append to ``into`` the groups this rank joins inside the block (whoever creates
    them), in creation order, each given the world's timeout. Recorded on error too,
    so that what was made can still be destroyed."""
    before = set(live_groups())
    try:
        yield into
    finally:
        made = [g for g in live_groups() if g not in before]
        timeout = world_timeout()
        for g in made:
            if timeout is not None:
                c10d._set_pg_timeout(timeout, g)  # torch has no public setter
        into.extend(made)


def destroy_groups(groups: list) -> None:
    """Destroy ``groups`` (this rank's, in creation order), newest first, skipping any
    destroyed already. Every rank calls it at the same point of the program: each rank's
    list follows the one global creation order, so two members of a group meet it in the
    same place among their other groups (NCCL's communicator teardown may synchronise)."""
    live = set(live_groups())
    for g in reversed(groups):
        if g in live and g is not c10d._get_default_group():
            dist.destroy_process_group(g)
    groups.clear()
