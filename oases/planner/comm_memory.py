"""The NCCL communicators a layout needs on each rank, and the device memory they hold.

Each NCCL communicator holds its own buffers and connections on the GPU, outside the
caching allocator the cost model counts (NCCL_BUFFSIZE per channel, peer and protocol;
NVLS multicast buffers on NVSwitch systems). A rank holds the world's communicator plus
one for each group it belongs to, as :func:`oases.parallel.ranks.new_group` makes them:
the same :class:`~oases.parallel.ranks.GroupSpec` lists the builders create from, the
same rules (no group under two ranks, the default group for one over the world at
pp = 1, one communicator for groups of the same ranks, one per point-to-point direction):

    layout (world 8)                  communicators per rank (world's included)
    dp 8 x tp 1, dp 1 x tp 8          1
    dp 2 x tp 4                       3       world, TP, DP
    dp 2 x tp 4, per-block degrees    6       + degree-2 subgroup, (2, 4) resharding
                                                and degree-2 gradient groups (degree 1's
                                                is the world, (1, t) resharding the
                                                degree-t subgroup)
    pp 4 x tp 2, a middle stage       6       world, TP, 2 boundaries x 2 directions
    dp 2 x cp 2 x tp 2                4       world, TP, DP (over dp x cp), cp ring

:data:`COMM_BYTES` is the figure per communicator, unless the cluster file sets
``nccl_communicator_gib``; on gloo communicators live in host memory and cost a plan
nothing (:func:`for_backend`). The planner takes ``count x figure`` off the device
memory a plan may use when it derives the limit from the cluster (an explicit limit is
taken as given, as the headroom is).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from oases.parallel.ranks import (GroupSpec, GroupTable, cp_specs, degree_specs, kv_specs,
                                  stage_specs, tie_specs, transfer_specs)

# One communicator's GPU memory when the cluster file does not say: 688 MB, what
# NVIDIA/nccl#964 measured per communicator of more than two ranks (544 MB for two) on
# four NVLink A100s after one all-reduce. Reports range from about 0.5 GB to 1.6 GB
# (NVIDIA/nccl#864; more with NVLS on NVSwitch systems, NCCL_NVLS_ENABLE=0 gives much of
# it back); NCCL_BUFFSIZE and the channel count scale it (NVIDIA/nccl#986).
COMM_BYTES = 688e6
GIB = 2**30


@dataclass(frozen=True)
class _Mesh:
    first: int
    dp: int
    tp: int


@dataclass(frozen=True)
class CommLayout:
    """What decides a layout's groups: per stage (dp, tp) and whether its blocks take
    degrees other than its tp (``mixed``: the per-block degree groups), and the model and
    pipeline options that add groups."""

    stages: tuple[tuple[int, int], ...]
    mixed: tuple[bool, ...]
    tie_embeddings: bool = False
    kv_heads: Optional[int] = None
    transfer: str = "broadcast"
    sequence_parallel: bool = False
    high_priority_tp: bool = False
    cp: int = 1  # each stage's cp groups (a stage's dp counts its cp ranks)

    def meshes(self) -> list[_Mesh]:
        out, first = [], 0
        for dp, tp in self.stages:
            out.append(_Mesh(first, dp, tp))
            first += dp * tp
        return out

    @property
    def world(self) -> int:
        return sum(dp * tp for dp, tp in self.stages)


def layout_specs(lay: CommLayout) -> list[GroupSpec]:
    """Every group of ``lay`` in the order the runtime creates them: the context's
    (:func:`oases.parallel.groups.build_context` or ``build_pipeline_context``; at pp = 1
    the degree groups when first used), then the pipeline runner's transfers (each
    boundary's activations, then its gradients)."""
    ms = lay.meshes()
    out = [g for s, m in enumerate(ms) for g in stage_specs(s, m.first, m.dp, m.tp,
                                                            lay.high_priority_tp)]
    out += [g for s, m in enumerate(ms) for g in kv_specs(s, m.first, m.dp, m.tp, m.tp,
                                                          lay.kv_heads)]
    for m, mixed in zip(ms, lay.mixed):
        if mixed:
            out += degree_specs(m.first, m.dp, m.tp, lay.kv_heads)
    # the ring's groups are point-to-point: a communicator each, wherever they come
    out += [g for s, m in enumerate(ms) for g in cp_specs(s, m.first, m.dp, m.tp, lay.cp)]
    if len(ms) > 1:
        if lay.tie_embeddings:
            out += tie_specs(ms[0], ms[-1])
        for a, b in zip(ms, ms[1:]):
            out += transfer_specs(a, b, lay.transfer, lay.sequence_parallel)
            out += transfer_specs(b, a, lay.transfer, lay.sequence_parallel)
    return out


def communicators(lay: CommLayout) -> list[int]:
    """Per rank, the NCCL communicators ``lay`` makes it hold: the world's and one per
    distinct group it belongs to, decided as :func:`oases.parallel.ranks.new_group` does."""
    table = GroupTable(lay.world)
    for spec in layout_specs(lay):
        options = ("high-priority",) if spec.high_priority else None
        choice = table.decide(spec.ranks, options, spec.p2p, spec.world)
        if choice is None:
            table.add(spec.ranks, options, spec.p2p)
    count = [1] * lay.world
    for e in table.entries.values():
        for r in e.ranks:
            count[r] += 1
    return count


def stage_counts(lay: CommLayout) -> list[int]:
    """Per stage, the most communicators any of its ranks holds."""
    count = communicators(lay)
    return [max(count[m.first:m.first + m.dp * m.tp]) for m in lay.meshes()]


def for_backend(cluster, backend: str):
    """``cluster`` with the memory of one communicator the run will pay: the file's
    ``nccl_communicator_gib`` or :data:`COMM_BYTES` on NCCL, none on gloo."""
    gib = 0.0
    if backend == "nccl":
        gib = cluster.nccl_communicator_gib if cluster.nccl_communicator_gib is not None \
            else COMM_BYTES / GIB
    return dataclasses.replace(cluster, nccl_communicator_gib=gib)


def per_communicator(cluster) -> float:
    """Bytes of one communicator on ``cluster`` (0 unless :func:`for_backend` or the file
    gave a figure)."""
    return float(getattr(cluster, "nccl_communicator_gib", None) or 0.0) * GIB


def pp1_layout(dp: int, tp: int, mixed: bool, kv_heads: Optional[int] = None,
               high_priority_tp: bool = False) -> CommLayout:
    return CommLayout(((dp, tp),), (mixed,), kv_heads=kv_heads,
                      high_priority_tp=high_priority_tp)


def pp1_bytes(cluster, dp: int, tp: int, kv_heads: Optional[int] = None,
              high_priority_tp: bool = False) -> tuple[float, float]:
    """(communicator memory of a pp = 1 run whose blocks all run at tp, what per-block
    degrees below tp add to it) per device: the planner takes the first off the limit and
    charges the second to plans that use a lower degree (:func:`oases.planner.ilp.solve`)."""
    per = per_communicator(cluster)
    uniform = stage_counts(pp1_layout(dp, tp, False, kv_heads, high_priority_tp))[0]
    mixed = stage_counts(pp1_layout(dp, tp, True, kv_heads, high_priority_tp))[0]
    return uniform * per, (mixed - uniform) * per


def choice_bytes(job, ch, cluster) -> list[float]:
    """Per stage of a layout search's choice (:class:`oases.planner.stages.Choice`), the
    memory of the communicators its ranks hold. A stage whose strategies include a degree
    below tp is counted with its per-block degree groups, whether or not the solution
    uses one (the stage problems have no term for it: conservative)."""
    mixed = set(ch.degrees) != {ch.tp}
    lay = CommLayout(((ch.mesh_dp, ch.tp),) * ch.pp, (mixed,) * ch.pp,
                     tie_embeddings=job.shape.tie_embeddings, kv_heads=job.shape.n_kv_heads,
                     transfer=job.pp_transfer, sequence_parallel=job.sequence_parallel,
                     cp=ch.cp)
    per = per_communicator(cluster)
    return [n * per for n in stage_counts(lay)]


def config_bytes(cfg, cluster, backend: str) -> tuple[float, float]:
    """:func:`pp1_bytes` of a validated config's pp = 1 run on ``backend``."""
    p = cfg.parallel
    return pp1_bytes(cluster, cfg.dp, p.tp, cfg.model.n_kv_heads,
                     bool(p.nccl_high_priority_tp) and backend == "nccl")
