"""Cluster files (``configs/cluster/*.yaml``) and the analytic collective model.

The same file drives the emulated cluster (benchmarks/cluster.py) and the
planner, so predicted and measured times refer to the same links. Pure Python.

Collective times follow the ring algorithms (alpha-beta model), over the
slowest link of the ring:

    all-reduce  2 (n-1) alpha + 2 (n-1)/n * M / B
    all-gather    (n-1) alpha +   (n-1)/n * M / B      (M: the gathered size)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from oases.errors import UserError


@dataclass
class Cluster:
    name: str
    nodes: int
    devices_per_node: int
    device_memory_gib: float
    intra_node_bandwidth_gbps: float
    inter_node_bandwidth_gbps: float
    latency_ms: float = 0.0
    bandwidth_matrix_gbps: Optional[list] = None

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    def link_gbps(self, a: int, b: int) -> float:
        """Bandwidth between global ranks a and b (rank r lives on node r // devices)."""
        na, nb = a // self.devices_per_node, b // self.devices_per_node
        if na == nb:
            return self.intra_node_bandwidth_gbps
        if self.bandwidth_matrix_gbps:
            return min(self.bandwidth_matrix_gbps[na][nb], self.bandwidth_matrix_gbps[nb][na])
        return self.inter_node_bandwidth_gbps

    def ring_gbps(self, ranks: list[int]) -> float:
        if len(ranks) < 2:
            return float("inf")
        return min(self.link_gbps(ranks[i], ranks[(i + 1) % len(ranks)]) for i in range(len(ranks)))

    def latency_s(self, ranks: list[int]) -> float:
        inter = len({r // self.devices_per_node for r in ranks}) > 1
        return self.latency_ms / 1e3 if inter else 0.0


def load_cluster(path: str) -> Cluster:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"cluster file {path} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError:
        raise UserError(f"cluster file {path} is not valid YAML") from None
    fields = {k: data[k] for k in Cluster.__dataclass_fields__ if k in data}
    missing = [k for k in ("name", "nodes", "devices_per_node", "device_memory_gib",
                           "intra_node_bandwidth_gbps", "inter_node_bandwidth_gbps")
               if k not in fields]
    if missing:
        raise UserError(f"cluster file {path} lacks {', '.join(missing)}")
    c = Cluster(**fields)
    m = c.bandwidth_matrix_gbps
    if m is not None and (len(m) != c.nodes or any(len(row) != c.nodes for row in m)):
        raise UserError(f"cluster file {path}: bandwidth_matrix_gbps must be {c.nodes} x {c.nodes}")
    return c


class CommModel:
    """Collective time for the ranks of a group; ``alpha``/``beta`` per group size can be
    replaced by measured fits (profile DB: ``{"all_reduce": {"2": [alpha, beta]}}``)."""

    def __init__(self, cluster: Cluster, measured: Optional[dict] = None) -> None:
        self.cluster = cluster
        self.measured = measured or {}

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
