"""Process groups for world = dp x tp, held in one explicit context object.

Rank layout (TP ranks contiguous, so a TP group stays inside one node):

    rank = dp_rank * tp + tp_rank
    world 4, tp 2:   tp groups {0,1} {2,3}     dp groups {0,2} {1,3}

GQA with more TP ranks than kv heads replicates each kv head on consecutive
ranks (oases.config.heads); their *kv replica groups* sum the kv gradients:

    world 4, tp 4, n_kv_heads 2:   kv replica groups {0,1} {2,3}

Layers receive the :class:`ParallelContext` (or its ``tp_group``) explicitly;
nothing in oases reads process groups from module globals. A context lists the groups
it created (``groups``); :meth:`ParallelContext.close` destroys them, which is how the
planner's trials give back a layout's communicators before the next one is built.

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
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from oases.errors import UserError
from oases.parallel.nccl_env import prepare_backend
from oases.parallel.ranks import (destroy_groups, kv_replica_ranks, new_group, new_groups,
                                  recording_groups, world_timeout)
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
    mesh: Optional[object] = None   # DeviceMesh ("dp", "tp"), used for DTensor checkpoints
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
    # The groups this context created and this rank belongs to, in creation order
    # (the default group is never among them): what close() destroys.
    groups: list = field(default_factory=list)

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def stage_size(self) -> int:
        return self.dp * self.tp

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

    def close(self) -> None:
        """Destroy the groups this context created; the context is unusable after.
        Collective: every rank closes its context at the same point of the program
        (a layout's trial, a throwaway profile)."""
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


def init_kwargs(backend: str, device: torch.device) -> dict:
    """``init_process_group``'s extra arguments: on NCCL the rank's GPU (``device_id``),
    so the world communicator is made at once, subgroups are split from it, and barriers
    run on that GPU rather than a guessed one. gloo gets none."""
    return {"device_id": device} if backend == "nccl" and device.type == "cuda" else {}


def high_priority_tp(backend: str, wanted: bool) -> bool:
    """Whether the TP groups get NCCL's high-priority streams
    (``parallel.nccl_high_priority_tp``): on NCCL only; gloo has no streams."""
    return wanted and backend == "nccl"


def tp_options(high_priority: bool):
    """``pg_options`` of a TP group: NCCL Options with high-priority streams, or None.
    The TP collectives sit on the critical path between a layer's matmuls; a
    high-priority stream lets their kernels start ahead of queued DP/ZeRO traffic."""
    if not high_priority:
        return None
    opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
    timeout = world_timeout()
    if timeout is not None:  # DeviceMesh takes the group's timeout from the options
        opts._timeout = timeout
    return opts


def init_distributed(tp: int, device: str = "auto", backend: str = "auto",
                     timeout_s: float = 600.0, layout=None,
                     tie_embeddings: bool = False,
                     kv_heads: Optional[int] = None,
                     nccl_high_priority_tp: bool = False) -> ParallelContext:
    """Join (or create, for a plain ``python train.py``) the default process group
    and build the dp x tp groups, or a pipelined ``layout``'s groups
    (:func:`build_pipeline_context`); with ``kv_heads`` (the model's), the kv replica
    groups too. Works with torchrun's environment variables."""
    dev = join_world(device, backend, timeout_s)
    if layout is not None and layout.pp > 1:
        return build_pipeline_context(layout, dev, tie_embeddings, kv_heads,
                                      nccl_high_priority_tp)
    return build_context(tp, dev, kv_heads, nccl_high_priority_tp)


def build_context(tp: int, device: torch.device, kv_heads: Optional[int] = None,
                  nccl_high_priority_tp: bool = False) -> ParallelContext:
    """dp x tp groups (and the kv replica groups of a model with ``kv_heads``) over an
    initialised default process group. Collective."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tp:
        raise UserError(f"parallel.tp={tp} does not divide the world size {world}")
    dp = world // tp
    made: list = []
    with recording_groups(made):
        opts = tp_options(high_priority_tp(dist.get_backend(), nccl_high_priority_tp))
        mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"),
                                backend_override={"tp": opts} if opts is not None else None)
        kv_group = new_groups(rank, kv_replica_ranks(0, dp, tp, tp, kv_heads))
    return ParallelContext(rank=rank, world_size=world, tp=tp, dp=dp,
                           tp_rank=rank % tp, dp_rank=rank // tp,
                           tp_group=mesh.get_group("tp"), dp_group=mesh.get_group("dp"),
                           device=device, mesh=mesh, kv_heads=kv_heads, kv_group=kv_group,
                           groups=made)


def build_pipeline_context(layout, device: torch.device, tie_embeddings: bool,
                           kv_heads: Optional[int] = None,
                           nccl_high_priority_tp: bool = False) -> ParallelContext:
    """The groups of a pipelined layout (oases.parallel.layout.PipelineLayout) over an initialised
    default process group; returns this rank's stage's context. Collective: every rank
    creates every group of every stage in the same order (``new_group`` requires it).

        stage s, replica d:  TP group  {first_s + d*tp_s + t : t < tp_s}
        stage s, position t: DP group  {first_s + d*tp_s + t : d < dp_s}
        stage s:             kv replica groups at tp_s (:func:`kv_replica_ranks`)
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if layout.world != world:
        raise UserError(f"the layout has {layout.world} ranks but the world size is {world}")
    made: list = []
    with recording_groups(made):
        parts = _pipeline_groups(layout, rank, world, tie_embeddings, kv_heads,
                                 high_priority_tp(dist.get_backend(), nccl_high_priority_tp))
    me, tp_group, dp_group, tie_group, degree_groups, kv_group = parts
    st = layout.stages[me]
    dp_rank, tp_rank = st.coords(rank)
    return ParallelContext(rank=rank, world_size=world, tp=st.tp, dp=st.dp, tp_rank=tp_rank,
                           dp_rank=dp_rank, tp_group=tp_group, dp_group=dp_group,
                           device=device, _degree_groups=degree_groups, pp=layout.pp,
                           stage=me, layout=layout, tie_group=tie_group, kv_heads=kv_heads,
                           kv_group=kv_group, groups=made)


def _pipeline_groups(layout, rank: int, world: int, tie_embeddings: bool,
                     kv_heads: Optional[int], high_priority: bool) -> tuple:
    """(this rank's stage, its tp, dp, tie groups, degree groups, kv group) of
    :func:`build_pipeline_context`, every group of every stage created in one order."""
    me = layout.stage_of(rank)
    tp_group = dp_group = tie_group = degree_groups = kv_group = None
    for s, st in enumerate(layout.stages):
        for d in range(st.dp):
            ranks = [st.first + d * st.tp + t for t in range(st.tp)]
            g = new_group(ranks, tp_options(high_priority))
            if rank in ranks:
                tp_group = g
        for t in range(st.tp):
            ranks = [st.first + d * st.tp + t for d in range(st.dp)]
            g = new_group(ranks)
            if rank in ranks:
                dp_group = g
    for s, st in enumerate(layout.stages):  # each stage's kv replicas at its own tp
        g = new_groups(rank, kv_replica_ranks(st.first, st.dp, st.tp, st.tp, kv_heads))
        if s == me:
            kv_group = g
    for s, st in enumerate(layout.stages):
        if st.degrees is not None and set(st.degrees) != {st.tp}:
            mine = s == me
            dg = DegreeGroups(rank, world, st.tp, st.dp, tp_group if mine else None,
                              dp_group if mine else None, base=st.first, kv_heads=kv_heads,
                              kv_group=kv_group if mine else None)
            if mine:
                degree_groups = dg
    first, last = layout.stages[0], layout.stages[-1]
    if tie_embeddings and layout.pp > 1 and first.tp == last.tp:
        for t in range(first.tp):  # the same vocabulary shard on both stages
            ranks = ([first.first + d * first.tp + t for d in range(first.dp)] +
                     [last.first + d * last.tp + t for d in range(last.dp)])
            g = new_group(ranks)
            if rank in ranks:
                tie_group = g
    elif tie_embeddings and layout.pp > 1:  # different shards: sum whole tables
        ranks = list(first.ranks) + list(last.ranks)
        g = new_group(ranks)
        if rank in ranks:
            tie_group = g
    return me, tp_group, dp_group, tie_group, degree_groups, kv_group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
