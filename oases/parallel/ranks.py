"""Rank lists of the groups a layout needs, their creation in one collective order, the
table that shares a group among the structures that need the same ranks, and the
bookkeeping that lets a throwaway build destroy what it created. Below both
:mod:`oases.parallel.groups` and :mod:`oases.parallel.reshard`.

Every group a layout needs is a :class:`GroupSpec`, listed in creation order by
:func:`stage_specs`, :func:`cp_specs`, :func:`node_specs`, :func:`kv_specs`, :func:`degree_specs`, :func:`tie_specs` and
:func:`transfer_specs`. The builders create from these lists and the planner counts
communicators from them (:mod:`oases.planner.comm_memory`), so both see one layout.

:func:`new_group` turns a spec's ranks into a group through the process's
:class:`GroupTable`, which decides alike on every rank (it sees the same requests in
the same order), so the collective ``dist.new_group`` calls stay in one order:

* fewer than two ranks: None, and nothing is created. The layers, engines, reducer and
  kv sums treat a None group as one rank, while NCCL gives even a one-rank communicator
  its buffers (NVIDIA/nccl#2363: 512 MiB);
* every rank of the world, no options: the default group itself, whose other
  collectives every rank issues at the same points of one program (pp = 1; the tie
  group, whose all-reduce each pipeline stage issues at its own point, says
  ``world=False``);
* the ranks of a live group made here, with the same options or none asked for: that
  group, shared. Two collective groups over one set of ranks may share a communicator
  because all their members run one program (one stage's action list), so each member
  issues the union of both groups' collectives in one order;
* ``p2p=True`` (a pipeline transfer): always a communicator of its own, never handed
  to another request (:mod:`oases.pipeline.cross_mesh` says why).

Each request is one *use*, a :class:`GroupRef` appended to every open
:func:`recording_groups` list; :func:`destroy_groups` gives uses back, and a group is
destroyed when its last use is given back. So a group shared by a context and a
throwaway step outlives the step, and none is destroyed twice.

A group made with ``timeout=None`` gets torch's default (30 min on gloo, 10 min on NCCL),
not the world's ``parallel.timeout_s``: :func:`new_group` and :func:`recording_groups`
give every group the world's, so that a hung peer times out alike on every group.
"""

from __future__ import annotations

import contextlib
import datetime
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from oases.config.heads import kv_replicas

# ---------------------------------------------------------------------------
# the groups of a layout, as data


@dataclass(frozen=True)
class GroupSpec:
    """One group a layout needs: its ranks and what it is for (``role``, ``key``: the
    stage, degree or pair of degrees it serves)."""

    role: str                       # tp dp cp kv sub reshard grad tie p2p fanout node
    ranks: tuple[int, ...]
    key: object = None
    high_priority: bool = False     # NCCL high-priority streams (the TP groups, when asked)
    p2p: bool = False               # point-to-point traffic: a communicator of its own
    world: bool = True              # may be the default group when it spans the world


def stage_specs(s: int, first: int, dp: int, tp: int, high_priority: bool = False
                ) -> list[GroupSpec]:
    """Stage ``s``'s TP groups (one per replica d), then its DP groups (one per position t):

        TP {first + d*tp + t : t < tp}        DP {first + d*tp + t : d < dp}"""
    out = [GroupSpec("tp", tuple(first + d * tp + t for t in range(tp)), s, high_priority)
           for d in range(dp)]
    out += [GroupSpec("dp", tuple(first + d * tp + t for d in range(dp)), s)
            for t in range(tp)]
    return out


def cp_specs(s: int, first: int, dp: int, tp: int, cp: int) -> list[GroupSpec]:
    """Stage ``s``'s context-parallel groups, its ``dp`` replicas being ``dp / cp`` data
    replicas of ``cp`` consecutive ones each: for data replica e and position t,

        CP {first + (e*cp + c)*tp + t : c < cp}

    Each carries only its ring's point-to-point exchanges, on a communicator of its own
    (a DP bucket's all-reduce queued on the same one would hold a ring step back)."""
    return [GroupSpec("cp", tuple(first + (e * cp + c) * tp + t for c in range(cp)), s,
                      p2p=True)
            for e in range(dp // cp) for t in range(tp)] if cp > 1 else []


def node_specs(stages, ranks_per_node: int) -> list[GroupSpec]:
    """Each DP group's members on one node, for every stage (objects with ``first``,
    ``dp``, ``tp``; rank r is on node ``r // ranks_per_node``): the groups ZeRO-3's
    node-local secondary shard gathers over (``parallel.zero_secondary=node``)."""
    out = []
    for s, st in enumerate(stages):
        for t in range(st.tp):
            nodes: dict[int, list[int]] = {}
            for d in range(st.dp):
                r = st.first + d * st.tp + t
                nodes.setdefault(r // ranks_per_node, []).append(r)
            out += [GroupSpec("node", tuple(rs), (s, t)) for rs in nodes.values()]
    return out


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


def kv_specs(key: object, first: int, dp: int, T: int, t: int,
             kv_heads: Optional[int]) -> list[GroupSpec]:
    return [GroupSpec("kv", tuple(r), key) for r in kv_replica_ranks(first, dp, T, t, kv_heads)]


def degree_specs(base: int, dp: int, T: int, kv_heads: Optional[int]) -> list[GroupSpec]:
    """The per-block degree groups of ``dp`` x ``T`` ranks from ``base``
    (:mod:`oases.parallel.reshard`): subgroups per degree, resharding groups per pair of
    degrees, gradient groups per degree below T, kv replica groups per degree below T."""
    degrees = [t for t in (2 ** i for i in range(T.bit_length())) if T % t == 0]
    out = [GroupSpec("sub", tuple(base + d * T + g * t + j for j in range(t)), t)
           for t in degrees if t not in (1, T) for d in range(dp) for g in range(T // t)]
    out += [GroupSpec("reshard", tuple(base + d * T + g * b + m * a + j for m in range(b // a)),
                      (a, b))
            for a in degrees for b in degrees if a < b
            for d in range(dp) for g in range(T // b) for j in range(a)]
    out += [GroupSpec("grad", tuple(base + d * T + g * t + j for d in range(dp)
                                    for g in range(T // t)), t)
            for t in degrees if t != T for j in range(t)]
    for t in degrees:
        if t < T:
            out += kv_specs(t, base, dp, T, t, kv_heads)
    return out


def tie_specs(first, last) -> list[GroupSpec]:
    """The tied embedding's groups between a pipeline's first and ``last`` stage (objects
    with ``first``, ``dp``, ``tp``): per TP position when both hold the same vocabulary
    shard, else one over both stages (whole tables). Their all-reduce runs at each stage's
    own point of the step, so none of them may be the default group."""
    if first.tp == last.tp:
        return [GroupSpec("tie", tuple([first.first + d * first.tp + t for d in range(first.dp)]
                                       + [last.first + d * last.tp + t for d in range(last.dp)]),
                          t, world=False)
                for t in range(first.tp)]
    ranks = list(range(first.first, first.first + first.dp * first.tp)) + \
        list(range(last.first, last.first + last.dp * last.tp))
    return [GroupSpec("tie", tuple(ranks), None, world=False)]


def transfer_specs(src, dst, method: str, sharded: bool) -> list[GroupSpec]:
    """The groups of one direction of one stage boundary (``src``/``dst``: objects with
    ``first``, ``dp``, ``tp``): its own point-to-point group over both meshes, then (for
    the broadcast and allgather fan-out of whole activations) each dst replica's."""
    both = sorted(list(range(src.first, src.first + src.dp * src.tp)) +
                  list(range(dst.first, dst.first + dst.dp * dst.tp)))
    out = [GroupSpec("p2p", tuple(both), (src.first, dst.first), p2p=True)]
    if method != "send" and not sharded:
        out += [GroupSpec("fanout", tuple(dst.first + j * dst.tp + t for t in range(dst.tp)), j)
                for j in range(dst.dp)]
    return out


# ---------------------------------------------------------------------------
# which request gets which group (pure: the same decisions on every rank)


def options_key(opts) -> Optional[tuple]:
    """What of a group's ``pg_options`` makes two groups differ (None: no options). Read
    by attribute: NCCL's Options are not comparable."""
    if opts is None:
        return None
    cfg = getattr(opts, "config", None)
    return (bool(getattr(opts, "is_high_priority_stream", False)),
            *(getattr(cfg, k, None) for k in ("blocking", "cga_cluster_size", "min_ctas",
                                              "max_ctas", "split_share")))


@dataclass
class _Entry:
    ranks: tuple[int, ...]
    options: Optional[tuple]
    p2p: bool
    group: object = None            # the ProcessGroup, or NON_GROUP_MEMBER outside it
    users: int = 0


@dataclass
class GroupTable:
    """The groups made through :func:`new_group` that are still in use, and how many uses
    each has. Pure bookkeeping: every rank keeps the same table, its non-member groups
    included, so every rank makes the same decision for each request."""

    world_size: int
    entries: dict = field(default_factory=dict)
    made: int = 0                   # entries ever added: their keys

    def decide(self, ranks: tuple[int, ...], options: Optional[tuple], p2p: bool,
               world: bool) -> Optional[object]:
        """"none" (under two ranks), "world" (the default group), the key of a live entry
        to share, or None (make a new group)."""
        if len(ranks) < 2:
            return "none"
        if p2p:
            return None
        if world and options is None and ranks == tuple(range(self.world_size)):
            return "world"
        for k, e in self.entries.items():   # the oldest first: the same choice everywhere
            if not e.p2p and e.ranks == ranks and (options is None or e.options == options):
                return k
        return None

    def add(self, ranks: tuple[int, ...], options: Optional[tuple], p2p: bool,
            group: object = None) -> int:
        key = self.made
        self.made += 1
        self.entries[key] = _Entry(ranks, options, p2p, group)
        return key

    def release(self, key: int) -> Optional[_Entry]:
        """One use of ``key`` given back; its entry once no use is left (then gone)."""
        e = self.entries.get(key)
        if e is None:
            return None
        e.users -= 1
        if e.users > 0:
            return None
        return self.entries.pop(key)


# ---------------------------------------------------------------------------
# the live groups of this process


@dataclass(eq=False)
class GroupRef:
    """One use of a group: what :func:`recording_groups` lists and :func:`destroy_groups`
    gives back. Compared by identity: two holders of one shared group hold two uses."""

    group: object                   # the ProcessGroup, or NON_GROUP_MEMBER outside it
    table: Optional[GroupTable] = field(default=None, repr=False)  # None: made elsewhere,
    key: Optional[int] = None                                      # destroyed when given back
    released: bool = False


def groups_of(uses: list) -> list[dist.ProcessGroup]:
    """The distinct groups this rank belongs to among ``uses`` (GroupRefs), in order."""
    out: list = []
    for ref in uses:
        if isinstance(ref.group, dist.ProcessGroup) and ref.group not in out:
            out.append(ref.group)
    return out


class _Live:
    """This process's table (a new one per world) and the open recordings."""

    def __init__(self) -> None:
        self.table: Optional[GroupTable] = None
        self.world: Optional[weakref.ref] = None
        self.recordings: list[list] = []

    def current(self) -> GroupTable:
        default = c10d._get_default_group()
        if self.world is None or self.world() is not default:  # a new world: nothing is live
            self.table, self.world = GroupTable(default.size()), weakref.ref(default)
        return self.table


# Like torch's own table of groups (c10d._world), one per process: new_group is a
# collective of the world, and a layout's structures (context, degree groups, pipeline
# transfers) that need the same ranks are built in different places.
_LIVE = _Live()


def new_group(ranks, pg_options=None, *, p2p: bool = False, world: bool = True,
              single: bool = False) -> Optional[dist.ProcessGroup]:
    """The group of ``ranks`` (the module docstring says which): None under two ranks
    (unless ``single``), the default group, a shared live one or a new one. Collective:
    every rank calls it, in the same order, with the same arguments (``pg_options`` may
    be a new object each time). The use is recorded in every open
    :func:`recording_groups` list."""
    ranks = tuple(sorted(ranks))
    table = _LIVE.current()
    opts = options_key(pg_options)
    choice = table.decide(ranks, opts, p2p, world)
    if choice == "none" and not single:
        return None
    if choice == "world":
        return c10d._get_default_group()
    if not isinstance(choice, int):
        choice = table.add(ranks, opts, p2p, _create(list(ranks), pg_options))
    entry = table.entries[choice]
    entry.users += 1
    ref = GroupRef(entry.group, table, choice)
    for into in _LIVE.recordings:
        into.append(ref)
    return entry.group


def _create(ranks: list[int], pg_options) -> dist.ProcessGroup:
    """``dist.new_group`` with the world's timeout (collective, as ``new_group`` is).
    ``pg_options`` (NCCL's Options) carries the same timeout: torch refuses two."""
    timeout = world_timeout()
    if pg_options is not None and timeout is not None:
        pg_options._timeout = timeout
    return dist.new_group(ranks, timeout=timeout, pg_options=pg_options)


def create_groups(rank: int, specs: list[GroupSpec],
                  options: Callable[[], object] = lambda: None) -> dict:
    """Every group of ``specs``, in order (collective); returns ``{(role, key): group}``
    for the groups ``rank`` belongs to (None for a one-rank one). ``options()``: a fresh
    ``pg_options`` for each spec that asks for high-priority streams."""
    mine: dict = {}
    for spec in specs:
        g = new_group(spec.ranks, options() if spec.high_priority else None, p2p=spec.p2p,
                      world=spec.world)
        if rank in spec.ranks:
            mine[(spec.role, spec.key)] = g
    return mine


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
    """Append to ``into`` a :class:`GroupRef` for each use of a group made inside the
    block through :func:`new_group` (whoever asks), in request order, and for each group
    this rank joins there by other means, each given the world's timeout. Recorded on
    error too, so that what was made can still be given back."""
    before = set(live_groups())
    _LIVE.recordings.append(into)
    try:
        yield into
    finally:
        at = max(i for i, r in enumerate(_LIVE.recordings) if r is into)  # this block's
        del _LIVE.recordings[at]
        table = _LIVE.current()
        ours = {e.group for e in table.entries.values()}
        made = [g for g in live_groups() if g not in before and g not in ours]
        timeout = world_timeout()
        for g in made:
            if timeout is not None:
                c10d._set_pg_timeout(timeout, g)  # torch has no public setter
        into.extend(GroupRef(g, None) for g in made)


def destroy_groups(groups: list) -> None:
    """Give back the uses ``groups`` lists (a recording's), newest first, and destroy each
    group whose last use that was; a use given back already is skipped. Every rank calls
    it at the same point of the program: the uses follow the one global request order on
    every rank, so two members of a group destroy it at the same place among their other
    groups (NCCL's communicator teardown may synchronise)."""
    table = _LIVE.current()
    for ref in reversed(groups):
        if ref.released:
            continue
        ref.released = True
        if ref.table is not None:
            if ref.table is not table or table.release(ref.key) is None:
                continue  # still in use, or of a world that is gone
        if ref.group in set(live_groups()) and ref.group is not c10d._get_default_group():
            dist.destroy_process_group(ref.group)
    groups.clear()
