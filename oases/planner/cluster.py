"""Cluster files (``configs/cluster/*.yaml``) and the analytic collective model.

The same file drives the emulated cluster (emucluster/cluster.py) and the
planner, so predicted and measured times refer to the same links and, where
nodes differ (``node_speed``, ``node_memory_gib``), the same devices. Pure Python.

A heterogeneous node's speed is relative to the device the planner profiled on;
a synchronous group (TP, DP) computes at the pace of its slowest member and
must fit in its smallest memory: :meth:`Cluster.speed_of`,
:meth:`Cluster.memory_bytes_of`. A plan may use that memory less a headroom
(:func:`usable_bytes`, :meth:`Cluster.plan_bytes_of`).

Collective times follow the ring algorithms (alpha-beta model), over the
slowest link of the ring:

    all-reduce  2 (n-1) alpha + 2 (n-1)/n * M / B
    all-gather    (n-1) alpha +   (n-1)/n * M / B      (M: the gathered size)
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from oases.errors import UserError

# What a plan must leave free on a device of B bytes: RESERVED_BYTES + RESERVED_FRACTION x B.
# The fixed part is memory the caching allocator never sees: the CUDA context (some
# hundreds of MiB) and library workspaces. NCCL's communicators, each with its own
# buffers, depend on the layout: oases.planner.comm_memory counts them per layout and
# the planner takes them off as well (nccl_communicator_gib each).
# The fraction is the allocator's: blocks rounded up and split, cached but too small for
# the next request; a few percent of what it holds when sizes vary from step to step.
# The cost model counts tensors only, so without it a plan that "fits" exactly fails
# with an out-of-memory error. An explicit limit (parallel.memory_limit_gib,
# --memory-gib) is taken as given.
RESERVED_BYTES = 2**30
RESERVED_FRACTION = 0.05


def usable_bytes(device_bytes: float) -> float:
    """Memory a plan may fill on a device of ``device_bytes``: less the headroom above."""
    return max(0.0, device_bytes * (1 - RESERVED_FRACTION) - RESERVED_BYTES)


@dataclass
class Cluster:
    """One cluster file (schema in the header comment of each ``configs/cluster/*.yaml``)."""

    name: str
    nodes: int
    devices_per_node: int
    device_memory_gib: float
    intra_node_bandwidth_gbps: float
    inter_node_bandwidth_gbps: float
    latency_ms: float = 0.0
    bandwidth_matrix_gbps: Optional[list] = None
    node_speed: Optional[list] = None       # per node, relative to the profiled device
    node_memory_gib: Optional[list] = None  # per node; default device_memory_gib each
    nccl_communicator_gib: Optional[float] = None  # one NCCL communicator's device memory
    subnet: str = "10.231.0.0/24"   # emulation only (emucluster/cluster.py)
    bridge: str = "oasesbr0"        # emulation only
    cpu_share: Optional[float] = None  # emulation only: cores per node at speed 1.0

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    @classmethod
    def load(cls, path: str | Path) -> "Cluster":
        return load_cluster(str(path))

    def node_gbps(self, i: int, j: int) -> float:
        """Rate from node i to node j (Gbit/s), as the emulated cluster shapes it."""
        if self.bandwidth_matrix_gbps is not None:
            return float(self.bandwidth_matrix_gbps[i][j])
        return float(self.inter_node_bandwidth_gbps)

    def link_gbps(self, a: int, b: int) -> float:
        """Bandwidth between global ranks a and b (rank r lives on node r // devices)."""
        na, nb = a // self.devices_per_node, b // self.devices_per_node
        if na == nb:
            return self.intra_node_bandwidth_gbps
        return min(self.node_gbps(na, nb), self.node_gbps(nb, na))

    def node_of(self, rank: int) -> int:
        """The node global rank ``rank`` lives on (ranks fill nodes in order). A rank
        beyond the cluster means the cluster file does not describe the run."""
        if not 0 <= rank < self.world:
            raise UserError(f"rank {rank} is outside cluster {self.name} ({self.nodes} nodes x "
                            f"{self.devices_per_node} devices): the cluster file does not fit "
                            f"the run")
        return rank // self.devices_per_node

    def speed_of(self, ranks) -> float:
        """Compute speed of a synchronous group: its slowest member's, since every
        collective waits for it (1.0 = the profiled device)."""
        if self.node_speed is None:
            return 1.0
        return min(float(self.node_speed[self.node_of(r)]) for r in ranks)

    def memory_bytes_of(self, ranks) -> float:
        """Memory a plan for these ranks may use per device: the smallest among
        them, since every rank of a group holds the same share (bytes)."""
        gib = self.node_memory_gib or [self.device_memory_gib] * self.nodes
        return min(float(gib[self.node_of(r)]) for r in ranks) * 2**30

    def plan_bytes_of(self, ranks) -> float:
        """The planner's limit for these ranks when none is given: their smallest
        device's memory less the headroom (:func:`usable_bytes`)."""
        return usable_bytes(self.memory_bytes_of(ranks))

    def ring_gbps(self, ranks: list[int]) -> float:
        if len(ranks) < 2:
            return float("inf")
        return min(self.link_gbps(ranks[i], ranks[(i + 1) % len(ranks)]) for i in range(len(ranks)))

    def latency_s(self, ranks: list[int]) -> float:
        inter = len({r // self.devices_per_node for r in ranks}) > 1
        return self.latency_ms / 1e3 if inter else 0.0

    def validate(self, where: str = "cluster") -> None:
        def bad(msg: str) -> UserError:
            return UserError(f"{where}: {msg}")

        for k in ("nodes", "devices_per_node"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(f"{k}={v!r} must be a positive integer")
        for k in ("device_memory_gib", "intra_node_bandwidth_gbps", "inter_node_bandwidth_gbps"):
            v = getattr(self, k)
            if not isinstance(v, (int, float)) or v <= 0:
                raise bad(f"{k}={v!r} must be a positive number")
        if not isinstance(self.latency_ms, (int, float)) or self.latency_ms < 0:
            raise bad(f"latency_ms={self.latency_ms!r} must be >= 0")
        m = self.bandwidth_matrix_gbps
        if m is not None:
            if (not isinstance(m, list) or len(m) != self.nodes
                    or any(not isinstance(r, list) or len(r) != self.nodes for r in m)):
                raise bad(f"bandwidth_matrix_gbps must be {self.nodes} x {self.nodes}")
            for i, row in enumerate(m):
                for j, v in enumerate(row):
                    if i != j and (not isinstance(v, (int, float)) or v <= 0):
                        raise bad(f"bandwidth_matrix_gbps[{i}][{j}]={v!r} must be positive")
        for k, top in (("node_speed", MAX_NODE_SPEED), ("node_memory_gib", None)):
            self._validate_per_node(k, top, bad)
        comm = self.nccl_communicator_gib
        if comm is not None and (not _is_number(comm) or comm < 0):
            raise bad(f"nccl_communicator_gib={comm!r} must be a number >= 0")
        if self.cpu_share is not None and (not _is_number(self.cpu_share) or self.cpu_share <= 0):
            raise bad(f"emulation.cpu_share={self.cpu_share!r} must be a positive number")
        try:
            net = ipaddress.ip_network(self.subnet)
        except ValueError:
            raise bad(f"emulation.subnet={self.subnet!r} is not a network") from None
        if not (net.version == 4 and net.is_private and net.prefixlen >= 16
                and net.num_addresses - 2 >= self.nodes):
            raise bad(f"emulation.subnet={self.subnet} must be a private IPv4 network "
                      f"(/16../30) with room for {self.nodes} nodes")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,15}", self.bridge):
            raise bad(f"emulation.bridge={self.bridge!r} is not a valid interface name")

    def _validate_per_node(self, key: str, top: Optional[float], bad) -> None:
        """``key`` absent, or one positive number (at most ``top``) per node."""
        v = getattr(self, key)
        if v is None:
            return
        if not isinstance(v, list) or len(v) != self.nodes:
            raise bad(f"{key} must be a list of {self.nodes} numbers (one per node), got {v!r}")
        for i, x in enumerate(v):
            if not _is_number(x) or x <= 0 or (top is not None and x > top):
                limit = f" <= {top:g}" if top is not None else ""
                raise bad(f"{key}[{i}]={x!r} must be a positive number{limit}")


MAX_NODE_SPEED = 16.0  # a larger ratio is a typo, not a cluster


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


_EMULATION_KEYS = ("subnet", "bridge", "cpu_share")  # parsed here, used only by the emulator
_REQUIRED = ("name", "nodes", "devices_per_node", "device_memory_gib",
             "intra_node_bandwidth_gbps", "inter_node_bandwidth_gbps")


def load_cluster(path: str) -> Cluster:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"cluster file {path} does not exist")
    try:
        d = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError:
        raise UserError(f"cluster file {path} is not valid YAML") from None
    if not isinstance(d, dict):
        raise UserError(f"cluster file {path} must be a mapping")
    known = set(Cluster.__dataclass_fields__) - set(_EMULATION_KEYS) | {"emulation"}
    unknown = sorted(set(d) - known)
    if unknown:
        raise UserError(f"cluster file {path}: unknown key(s) {', '.join(unknown)}")
    emu = d.pop("emulation", None) or {}
    if not isinstance(emu, dict) or set(emu) - set(_EMULATION_KEYS):
        raise UserError(f"cluster file {path}: emulation takes only "
                        f"{', '.join(_EMULATION_KEYS[:-1])} and {_EMULATION_KEYS[-1]}")
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise UserError(f"cluster file {path}: missing key(s) {', '.join(missing)}")
    c = Cluster(**d, **emu)
    c.validate(f"cluster file {path}")
    return c


def tp_groups(t: int, tp: int, dp: int) -> list[list[int]]:
    """The degree-t subgroups of a run of dp TP groups of tp ranks (ranks d*tp + ..)."""
    return [[d * tp + g * t + j for j in range(t)] for d in range(dp) for g in range(tp // t)]


def reshard_groups(a: int, b: int, tp: int, dp: int) -> list[list[int]]:
    """The all-gather groups between degrees a < b (oases.parallel.reshard)."""
    return [[d * tp + g * b + m * a + j for m in range(b // a)]
            for d in range(dp) for g in range(tp // b) for j in range(a)]


def grad_groups(t: int, tp: int, dp: int) -> list[list[int]]:
    """The replicas whose gradients a degree-t block sums: its tp/t copies x dp."""
    return [[d * tp + g * t + j for d in range(dp) for g in range(tp // t)] for j in range(t)]


_GROUPS = {"all_reduce": lambda k, tp, dp: tp_groups(int(k), tp, dp),
           "grad_all_reduce": lambda k, tp, dp: grad_groups(int(k), tp, dp),
           "all_gather": lambda k, tp, dp: reshard_groups(*map(int, k.split("-")), tp, dp)}


class CommModel:
    """Collective time for the ranks of a group; ``alpha``/``beta`` per group size can be
    replaced by measured fits (profile DB: ``{"all_reduce": {"2": [alpha, beta]}}``).

    A fit measured on some groups prices other groups of the same kind through
    :meth:`fitted`: its alpha (latency and software, which the links do not change) as
    measured, its per-byte term scaled by how much longer the ring algorithm keeps
    the bytes on the slowest link of the groups priced than on those measured
    (``measured["on"]``: the run's tp x dp, global ranks from 0)."""

    def __init__(self, cluster: Cluster, measured: Optional[dict] = None) -> None:
        self.cluster = cluster
        self.measured = measured or {}
        # the cluster's own numbering (a stage's view renumbers its ranks from 0)
        self.root = getattr(cluster, "cluster", cluster)

    @staticmethod
    def _wire(kind: str, ranks: list[int], cluster) -> float:
        """Seconds per byte the ring keeps on the slowest link of ``ranks``."""
        n = len(ranks)
        if n < 2:
            return 0.0
        share = (n - 1) / n * (1 if kind == "all_gather" else 2)
        return share / (cluster.ring_gbps(ranks) * 1e9 / 8)

    def fitted(self, kind: str, key: str, nbytes: float, groups: list[list[int]]
               ) -> Optional[float]:
        """The measured fit ``kind``/``key`` for ``groups`` (all running at once; the
        slowest sets the pace), or None without a fit."""
        fit = self.measured.get(kind, {}).get(key)
        if not fit:
            return None
        beta = fit[1]
        on = self.measured.get("on")
        if on and on["tp"] * on["dp"] <= self.root.world:
            ref = _GROUPS[kind](key, on["tp"], on["dp"])
            here = max(self._wire(kind, g, self.cluster) for g in groups)
            there = max(self._wire(kind, g, self.root) for g in ref)
            if here > 0 and there > 0:
                beta *= here / there
        return fit[0] + beta * nbytes

    def _fit(self, kind: str, n: int):
        f = self.measured.get(kind, {}).get(str(n))
        return tuple(f) if f else None

    def all_reduce(self, nbytes: float, ranks: list[int]) -> float:
        n = len(ranks)
        if n < 2:
            return 0.0
        fit = self._fit("all_reduce", n)
        if fit:
            return fit[0] + fit[1] * nbytes
        bw = self.cluster.ring_gbps(ranks) * 1e9 / 8
        return 2 * (n - 1) * self.cluster.latency_s(ranks) + 2 * (n - 1) / n * nbytes / bw

    def all_gather(self, nbytes_total: float, ranks: list[int]) -> float:
        n = len(ranks)
        if n < 2:
            return 0.0
        fit = self._fit("all_gather", n)
        if fit:
            return fit[0] + fit[1] * nbytes_total
        bw = self.cluster.ring_gbps(ranks) * 1e9 / 8
        return (n - 1) * self.cluster.latency_s(ranks) + (n - 1) / n * nbytes_total / bw


class StageLinks:
    """The cluster seen by one stage's :class:`CostModel`, which numbers the stage's
    ranks 0.. in its groups (TP group 0..tp-1, replica d at d*tp..): rank r is global
    ``first + r``. Anything else (``speed_of``, which the cost model asks with global
    ranks) is the cluster's."""

    def __init__(self, cluster, first: int) -> None:
        self.cluster, self.first = cluster, first

    def ring_gbps(self, ranks: list[int]) -> float:
        return self.cluster.ring_gbps([self.first + r for r in ranks])

    def latency_s(self, ranks: list[int]) -> float:
        return self.cluster.latency_s([self.first + r for r in ranks])

    def __getattr__(self, name):
        return getattr(self.cluster, name)
