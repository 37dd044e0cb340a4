"""Process groups for world = dp x tp, held in one explicit context object.

Rank layout (TP ranks contiguous, so a TP group stays inside one node):

    rank = dp_rank * tp + tp_rank
    world 4, tp 2:   tp groups {0,1} {2,3}     dp groups {0,2} {1,3}

Context parallelism (cp > 1) splits each data replica's sequences over cp consecutive
DP ranks: ``dp`` counts every replica of the parameters (the gradient sum and ZeRO run
over all dp x cp of them), ``dp_rank = data_rank * cp + cp_rank``, and the cp group is
the cp ranks at one TP position of one data replica:

    world 8, tp 2, cp 2:   dp groups {0,2,4,6} {1,3,5,7}   cp groups {0,2} {1,3} {4,6} {5,7}

GQA with more TP ranks than kv heads replicates each kv head on consecutive
ranks (oases.config.heads); their *kv replica groups* sum the kv gradients:

    world 4, tp 4, n_kv_heads 2:   kv replica groups {0,1} {2,3}

Layers receive the :class:`ParallelContext` (or its ``tp_group``) explicitly;
nothing in oases reads process groups from module globals. The groups come from
:func:`oases.parallel.ranks.new_group`: a group of one rank is None (tp = 1, dp = 1),
one spanning the world at pp = 1 is the default group, and structures that need the
same ranks share one communicator (docs/architecture.md lists them). A context lists
its uses of groups (``groups``); :meth:`ParallelContext.close` gives them back and
destroys those no one else uses, which is how the planner's trials give back a
layout's communicators before the next one is built.

On NCCL, ``work.wait()`` neither blocks the host nor raises: a hung peer is found by
the process group's watchdog, which oases has abort the communicators (without taking
the process down), so that the run's next collective raises and the run ends as on
every other collective failure, with one line and exit status 4
(:mod:`oases.parallel.nccl_env`).
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from oases.errors import ConfigError, UserError
from oases.parallel.layout import StageLayout
from oases.parallel.nccl_env import prepare_backend
from oases.parallel.ranks import (cp_specs, create_groups, destroy_groups, kv_specs, new_group,
                                  node_specs, recording_groups, stage_specs, tie_specs)
from oases.parallel.reshard import DegreeGroups


@dataclass
class ParallelContext:
    rank: int
    world_size: int
    tp: int
    dp: int
    tp_rank: int
    dp_rank: int
    tp_group: Optional[dist.ProcessGroup]
    dp_group: Optional[dist.ProcessGroup]
    device: torch.device
    _degree_groups: Optional[object] = None
    # Pipeline (pp > 1): tp, dp and their groups above are this rank's *stage*'s; the
    # layout (oases.parallel.layout.PipelineLayout) says where every stage lives.
    pp: int = 1
    stage: int = 0
    layout: Optional[object] = None
    # First and last stage with tied embeddings: the ranks at this TP position on both
    # stages, over which the two copies' gradients are summed.
    tie_group: Optional[dist.ProcessGroup] = None
    # The model's kv heads, and the ranks of this TP group holding the same kv head as
    # this one (None: kv heads are not replicated at this tp).
    kv_heads: Optional[int] = None
    kv_group: Optional[dist.ProcessGroup] = None
    # Context parallelism: this rank's index in its cp group, of cp (dp above counts the
    # cp ranks: dp / cp data replicas read their own rows)
    cp: int = 1
    cp_rank: int = 0
    cp_group: Optional[dist.ProcessGroup] = None
    # This context's uses of groups (oases.parallel.ranks.GroupRef), on every rank, member
    # or not, in request order (the default group is never among them): what close()
    # gives back.
    groups: list = field(default_factory=list)

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def data_dp(self) -> int:
        """Replicas that read their own rows of the global batch (dp / cp)."""
        return self.dp // self.cp

    @property
    def data_rank(self) -> int:
        """This rank's data replica: the rows it reads (its cp peers read the same)."""
        return self.dp_rank // self.cp

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def stage_size(self) -> int:
        return self.dp * self.tp

    @property
    def built_degree_groups(self):
        """The groups for per-block TP degrees if they exist (a plan or a pipeline stage
        made them), else None; never creates them."""
        return self._degree_groups

    def degree_groups(self):
        """Groups for per-block TP degrees (built on first use; collective: every rank
        must call it at the same point)."""
        if self._degree_groups is None:
            with recording_groups(self.groups):
                self._degree_groups = DegreeGroups(self.rank, self.world_size, self.tp,
                                                   self.dp, self.tp_group, self.dp_group,
                                                   kv_heads=self.kv_heads,
                                                   kv_group=self.kv_group)
        return self._degree_groups

    def node_group(self, ranks_per_node: int) -> tuple[Optional[dist.ProcessGroup], int, int]:
        """This rank's DP group's members on its node, for ZeRO-3's secondary shard:
        (their group, None for this rank alone; how many; this rank's index among them).
        Collective: every rank of the world calls it at the same point; every stage's
        groups are made. Refused alike on every rank where some DP group's members on a
        node do not divide it evenly (the shards would differ in size)."""
        stages = (self.layout.stages if self.layout is not None else
                  [StageLayout((0, 0), self.dp, self.tp, 0)])
        specs = node_specs(stages, ranks_per_node)
        for st in stages:
            sizes = {len(sp.ranks) for sp in specs if sp.ranks[0] in st.ranks}
            if len(sizes) > 1 or st.dp % max(sizes) != 0:
                raise ConfigError(
                    f"parallel.zero_secondary=node: the dp {st.dp} ranks of a DP group sit "
                    f"{sorted(sizes)} to a node ({ranks_per_node} ranks per node, tp "
                    f"{st.tp}); each node must hold the same number of them")
        with recording_groups(self.groups):
            mine = create_groups(self.rank, specs)
        (key, group), = [(k, g) for k, g in mine.items() if k[0] == "node"]
        ranks = next(sp.ranks for sp in specs if sp.key == key[1] and self.rank in sp.ranks)
        return group, len(ranks), ranks.index(self.rank)

    def device_mesh(self):
        """A DeviceMesh ("dp", "tp") over this context's own groups, for DTensor (pp = 1).
        ``DeviceMesh.from_group`` creates no group (torch 2.13 registers the ones it is
        given), unlike ``init_device_mesh``; only a dimension of one rank, which has no
        group here, gets one-rank groups, made now and given back by :meth:`close`.
        Collective: every rank calls it at the same point."""
        from torch.distributed.device_mesh import DeviceMesh  # deferred: DTensor users only
        if self.pp > 1:
            raise ValueError("device_mesh() describes a pp = 1 context; a pipeline stage's "
                             "groups are not one mesh")
        dims = []
        specs = stage_specs(0, 0, self.dp, self.tp)
        with recording_groups(self.groups):
            for group, role in ((self.dp_group, "dp"), (self.tp_group, "tp")):
                if group is None:
                    for spec in specs:
                        if spec.role == role:
                            g = new_group(spec.ranks, single=True)
                            group = g if self.rank in spec.ranks else group
                dims.append(group)
        mesh = torch.arange(self.world_size).view(self.dp, self.tp)
        return DeviceMesh.from_group(dims, self.device.type, mesh, mesh_dim_names=("dp", "tp"))

    def close(self) -> None:
        """Give back this context's uses of groups, destroying each one no one else uses;
        the context is unusable after. Collective: every rank closes its context at the
        same point of the program (a layout's trial, a throwaway profile)."""
        destroy_groups(self.groups)
        self._degree_groups = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> "ParallelContext":
        """A world of one process without torch.distributed (tp = dp = 1)."""
        return cls(0, 1, 1, 1, 0, 0, None, None, torch.device(device))


def pick_device(requested: str = "auto") -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("parallel.device=cuda but CUDA is not available on this machine")
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank >= torch.cuda.device_count():
        raise UserError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA "
                        f"devices are visible")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device, backend: str = "auto") -> str:
    """``parallel.backend``'s process-group backend on ``device``: auto is NCCL on CUDA,
    gloo elsewhere."""
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return backend


def join_world(device: str = "auto", backend: str = "auto",
               timeout_s: float = 600.0) -> torch.device:
    """Join (or create, for a plain ``python train.py``) the default process group, if
    not joined yet; returns the device. No other group is made."""
    dev = pick_device(device)
    backend = backend_for(dev, backend)
    if backend == "nccl" and dev.type != "cuda":
        raise UserError("parallel.backend=nccl needs CUDA; use gloo on CPU")
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python train.py`: a world of one
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        prepare_backend(backend)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                **init_kwargs(backend, dev))
    return dev


def init_kwargs(backend: str, device: torch.device, split_share: bool = False,
                timeout: Optional[datetime.timedelta] = None) -> dict:
    """``init_process_group``'s extra arguments: on NCCL the rank's GPU (``device_id``),
    so the world communicator is made at once, subgroups are split from it, and barriers
    run on that GPU rather than a guessed one; with ``split_share``, the world's
    ``pg_options`` of :func:`world_options` (with the world's ``timeout``, which torch
    would otherwise warn about). gloo gets none."""
    if not (backend == "nccl" and device.type == "cuda"):
        return {}
    kw: dict = {"device_id": device}
    opts = world_options(backend, split_share)
    if opts is not None:
        if timeout is not None:
            opts._timeout = timeout
        kw["pg_options"] = opts
    return kw


# NCCL's resource sharing (ncclConfig_t.splitShare, or NCCL_COMM_SPLIT_SHARE_RESOURCES=1,
# which NCCL applies to every communicator it makes). NCCL reads it from the *parent*
# when ncclCommSplit makes a child (src/init.cc, ncclCommInitChildComm:
# comm->shareResources = ... comm->config.splitShare), and torch splits every subgroup
# from the world's communicator once the world is bound to a GPU (init_kwargs'
# device_id): the world's options are the one place it takes effect, and a subgroup's
# Options with split_share do nothing. A shared child reuses the parent's channels,
# buffers and proxy instead of its own. But its kernels then also wait for the family's
# previous kernel: every launch first waits for the shared device stream, which each
# launch advances to its own completion (src/enqueue.cc: ncclLaunchPrepare,
# ncclLaunchFinish; NCCL 2.27 and since). All of a GPU's communicators become one
# in-order queue:
# * with pipeline stages that deadlocks, as one group for both directions of a boundary
#   does (oases.pipeline.p2p): a receive posted early holds the queue, and with it the
#   send its partner waits for;
# * at pp = 1 the DP all-reduces, which the reducer overlaps with the last backward,
#   hold up the TP collectives behind them, which sit between the oases engine's
#   matmuls.
# So oases leaves sharing off: world_options builds it for whoever asks, and a pipelined
# layout refuses the environment variable (check_split_share).
SPLIT_SHARE_VAR = "NCCL_COMM_SPLIT_SHARE_RESOURCES"


def world_options(backend: str, split_share: bool):
    """The world's ``pg_options`` on NCCL with ``split_share``: Options whose
    ``config.split_share`` is 1, so that the subgroups split from the world share its
    resources (see the comment above for the cost). None on gloo or unasked."""
    if backend != "nccl" or not split_share:
        return None
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.split_share = 1
    return opts


def check_split_share(environ: Mapping[str, str], backend: str, pp: int) -> None:
    """Refuse NCCL resource sharing in a pipelined layout (it serialises the pipeline's
    point-to-point groups with every other communicator: deadlock). gloo ignores it."""
    if backend == "nccl" and pp > 1 and environ.get(SPLIT_SHARE_VAR, "").strip() == "1":
        raise UserError(f"{SPLIT_SHARE_VAR}=1 with parallel.pp={pp}: NCCL then runs all of "
                        f"a GPU's communicators as one queue, where the pipeline's receives, "
                        f"posted early, deadlock; unset it or use parallel.pp=1")


def high_priority_tp(backend: str, wanted: bool) -> bool:
    """Whether the TP groups get NCCL's high-priority streams
    (``parallel.nccl_high_priority_tp``): on NCCL only; gloo has no streams."""
    return wanted and backend == "nccl"


def tp_options(high_priority: bool):
    """``pg_options`` of a TP group: NCCL Options with high-priority streams, or None.
    The TP collectives sit on the critical path between a layer's matmuls; a
    high-priority stream lets their kernels start ahead of queued DP/ZeRO traffic.
    A new object each call: torch writes each group's own fields into its options."""
    if not high_priority:
        return None
    return dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)


def init_distributed(tp: int, device: str = "auto", backend: str = "auto",
                     timeout_s: float = 600.0, layout=None,
                     tie_embeddings: bool = False,
                     kv_heads: Optional[int] = None,
                     nccl_high_priority_tp: bool = False, cp: int = 1) -> ParallelContext:
    """Join (or create, for a plain ``python train.py``) the default process group
    and build the dp x tp groups, or a pipelined ``layout``'s groups
    (:func:`build_pipeline_context`); with ``kv_heads`` (the model's), the kv replica
    groups too, and with ``cp`` > 1 the cp groups. Works with torchrun's environment
    variables."""
    dev = join_world(device, backend, timeout_s)
    if layout is not None and layout.pp > 1:
        return build_pipeline_context(layout, dev, tie_embeddings, kv_heads,
                                      nccl_high_priority_tp, cp)
    return build_context(tp, dev, kv_heads, nccl_high_priority_tp, cp)


def build_context(tp: int, device: torch.device, kv_heads: Optional[int] = None,
                  nccl_high_priority_tp: bool = False, cp: int = 1) -> ParallelContext:
    """dp x tp groups (and the kv replica groups of a model with ``kv_heads``, the cp
    groups at ``cp`` > 1) over an initialised default process group. Collective."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % (tp * cp):
        raise UserError(f"parallel.tp={tp} x parallel.cp={cp} does not divide the world "
                        f"size {world}")
    dp = world // tp
    hp = high_priority_tp(dist.get_backend(), nccl_high_priority_tp)
    made: list = []
    with recording_groups(made):
        mine = create_groups(rank, stage_specs(0, 0, dp, tp, hp) +
                             kv_specs(0, 0, dp, tp, tp, kv_heads) + cp_specs(0, 0, dp, tp, cp),
                             lambda: tp_options(hp))
    return ParallelContext(rank=rank, world_size=world, tp=tp, dp=dp,
                           tp_rank=rank % tp, dp_rank=rank // tp,
                           tp_group=mine.get(("tp", 0)), dp_group=mine.get(("dp", 0)),
                           device=device, kv_heads=kv_heads, kv_group=mine.get(("kv", 0)),
                           cp=cp, cp_rank=(rank // tp) % cp, cp_group=mine.get(("cp", 0)),
                           groups=made)


def build_pipeline_context(layout, device: torch.device, tie_embeddings: bool,
                           kv_heads: Optional[int] = None,
                           nccl_high_priority_tp: bool = False, cp: int = 1) -> ParallelContext:
    """The groups of a pipelined layout (oases.parallel.layout.PipelineLayout) over an initialised
    default process group; returns this rank's stage's context. Collective: every rank
    creates every group of every stage in the same order (``new_group`` requires it).

        stage s, replica d:  TP group  {first_s + d*tp_s + t : t < tp_s}
        stage s, position t: DP group  {first_s + d*tp_s + t : d < dp_s}
        stage s:             kv replica groups at tp_s
                             (:func:`oases.parallel.ranks.kv_replica_ranks`)
        cp > 1:              each stage's cp groups (:func:`oases.parallel.ranks.cp_specs`)
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if layout.world != world:
        raise UserError(f"the layout has {layout.world} ranks but the world size is {world}")
    check_split_share(os.environ, dist.get_backend(), layout.pp)
    made: list = []
    with recording_groups(made):
        parts = _pipeline_groups(layout, rank, world, tie_embeddings, kv_heads,
                                 high_priority_tp(dist.get_backend(), nccl_high_priority_tp))
        if cp > 1:
            if any(st.dp % cp for st in layout.stages):
                raise UserError(f"parallel.cp={cp} does not divide every stage's dp "
                                f"{[st.dp for st in layout.stages]}")
            cp_mine = create_groups(rank, [g for s, st in enumerate(layout.stages)
                                           for g in cp_specs(s, st.first, st.dp, st.tp, cp)])
    me, tp_group, dp_group, tie_group, degree_groups, kv_group = parts
    st = layout.stages[me]
    dp_rank, tp_rank = st.coords(rank)
    return ParallelContext(rank=rank, world_size=world, tp=st.tp, dp=st.dp, tp_rank=tp_rank,
                           dp_rank=dp_rank, tp_group=tp_group, dp_group=dp_group,
                           device=device, _degree_groups=degree_groups, pp=layout.pp,
                           stage=me, layout=layout, tie_group=tie_group, kv_heads=kv_heads,
                           kv_group=kv_group, cp=cp, cp_rank=dp_rank % cp,
                           cp_group=cp_mine.get(("cp", me)) if cp > 1 else None, groups=made)


def _pipeline_groups(layout, rank: int, world: int, tie_embeddings: bool,
                     kv_heads: Optional[int], high_priority: bool) -> tuple:
    """(this rank's stage, its tp, dp, tie groups, degree groups, kv group) of
    :func:`build_pipeline_context`, every group of every stage created in one order:
    each stage's TP and DP groups, each stage's kv replica groups, the degree groups of
    each stage whose blocks take their own degrees, the tie groups."""
    me = layout.stage_of(rank)
    specs = [g for s, st in enumerate(layout.stages)
             for g in stage_specs(s, st.first, st.dp, st.tp, high_priority)]
    specs += [g for s, st in enumerate(layout.stages)
              for g in kv_specs(s, st.first, st.dp, st.tp, st.tp, kv_heads)]
    mine = create_groups(rank, specs, lambda: tp_options(high_priority))
    tp_group, dp_group, kv_group = (mine.get((r, me)) for r in ("tp", "dp", "kv"))
    degree_groups = None
    for s, st in enumerate(layout.stages):
        if st.degrees is not None and set(st.degrees) != {st.tp}:
            ours = s == me
            dg = DegreeGroups(rank, world, st.tp, st.dp, tp_group if ours else None,
                              dp_group if ours else None, base=st.first, kv_heads=kv_heads,
                              kv_group=kv_group if ours else None)
            if ours:
                degree_groups = dg
    tie_group = None
    if tie_embeddings and layout.pp > 1:
        tied = create_groups(rank, tie_specs(layout.stages[0], layout.stages[-1]))
        tie_group = next(iter(tied.values()), None)
    return me, tp_group, dp_group, tie_group, degree_groups, kv_group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
