"""Build what a training run needs on this rank: its (stage's) model, the schedule
engine, the optimizer, the gradient reducer and, pipelined, the pipeline runner."""

from __future__ import annotations

import os
from typing import Optional, Union

import torch

from oases.models import Parallelism, arch_class, build
from oases.config import Config
from oases.config.schema import BF16_PRECISIONS, resolve_precision
from oases.pipeline.schedules import SPLIT_KINDS, VIRTUAL_KINDS
from oases.dp.reducer import REDUCE_DTYPES, GradReducer, TiedTableSync
from oases.dp.zero import NodeShard
from oases.dp.replicas import ReplicaGradSum, SequenceGradSum
from oases.overlap.engines import build_engine
from oases.parallel.groups import ParallelContext
from oases.parallel.engine import ShiftedParams
from oases.parallel.random import ChunkRNG, TPRNGTracker
from oases.parallel.ranks import destroy_groups, recording_groups
from oases.parallel.reshard import grad_group_of, kv_group_of
from oases.parallel.timing import IntervalTimer
from oases.pipeline.runner import Chunk, PipelineRunner
from oases.planner.cluster import load_cluster
from oases.planner.plan_file import check_zero, load_plan
from oases.runtime.cp_data import CpShards
from oases.runtime.optim import build_optimizer
from oases.runtime.state import TrainState
from oases.runtime.step import train_step

# Mixed into the default seed per pipeline stage, so that stages draw different
# dropout masks (as the layers of one model do at pp = 1)
_STAGE_SEED_STRIDE = 7_919


def seed_tracker(cfg: Config, ctx: ParallelContext) -> Union[TPRNGTracker, ChunkRNG]:
    """This rank's random streams: its stage's tracker, or under interleaved-1f1b one per
    chunk (:class:`~oases.parallel.random.ChunkRNG`), each seeded as the stage of its
    layers at pp x pp_virtual would be."""
    if interleaved(cfg, ctx):
        return ChunkRNG(ctx.device, [cfg.seed + _STAGE_SEED_STRIDE * g
                                     for g in virtual_stages(cfg, ctx)], ctx.tp_rank, ctx.dp_rank)
    tracker = TPRNGTracker(ctx.device)
    tracker.seed(cfg.seed + _STAGE_SEED_STRIDE * ctx.stage, ctx.tp_rank, ctx.dp_rank)
    return tracker


def interleaved(cfg: Config, ctx: ParallelContext) -> bool:
    """This rank runs several virtual stages (``pp_schedule=interleaved-1f1b``)."""
    return ctx.layout is not None and cfg.parallel.pp_schedule in VIRTUAL_KINDS


def virtual_stages(cfg: Config, ctx: ParallelContext) -> list[int]:
    """The virtual stages of this rank, by chunk: chunk c is stage c * pp + rank's stage
    (Megatron's assignment, :func:`oases.pipeline.actions.peer`)."""
    return [c * ctx.pp + ctx.stage for c in range(cfg.parallel.pp_virtual)]


def chunk_ranges(cfg: Config, ctx: ParallelContext) -> tuple[tuple[int, int], ...]:
    """The layers [a, b) of each of this rank's chunks: pp x pp_virtual equal stages
    (:meth:`~oases.parallel.layout.PipelineLayout.chunks`, which refuses a plan's layout
    of other layer ranges or degrees)."""
    return ctx.layout.chunks(ctx.stage, cfg.parallel.pp_virtual)


def build_rank_model(cfg: Config, ctx: ParallelContext, tracker: TPRNGTracker,
              degrees: Optional[list[int]], seed: Optional[int]):
    """This rank's model: at pp = 1 all of it with ``degrees`` (None: all at tp); in a
    pipeline its stage's layers with the stage's degrees. ``seed`` None: uninitialised."""
    par = cfg.parallel
    # the model does megatron's recompute, and selective under either engine
    recompute = par.recompute if par.schedule == "megatron" or par.recompute == "selective" \
        else "none"
    vocab, stage, chunks = cfg.padded_vocab_size, None, None
    if interleaved(cfg, ctx):  # several chunks of layers, at the rank's one degree
        vocab, chunks, degrees = cfg.padded_vocab(ctx.tp), chunk_ranges(cfg, ctx), None
    elif ctx.layout is not None:  # the stage's layers, with the stage's degrees
        st = ctx.layout.stages[ctx.stage]
        vocab, stage = cfg.padded_vocab(ctx.tp), st.layers
        degrees = list(st.degrees) if st.degrees is not None else None
        if degrees is not None and set(degrees) == {ctx.tp}:
            degrees = None
    plan = Parallelism(ctx.tp_group, None if chunks else tracker, recompute,
                       tuple(degrees) if degrees is not None else None,
                       ctx.degree_groups() if degrees is not None else None, stage,
                       par.sequence_parallel, par.compile,
                       # a zero-bubble schedule's B leaves the linear layers' dW to its W
                       defer_weight_grads=ctx.layout is not None and
                       par.pp_schedule in SPLIT_KINDS, chunks=chunks,
                       chunk_trackers=tuple(tracker.trackers) if chunks else None,
                       cp_group=ctx.cp_group, cp_overlap=par.cp_overlap,
                       cp_clock=IntervalTimer(ctx.device) if ctx.cp > 1 else None)
    return build(arch_class(cfg.model.arch), cfg.model, vocab, plan, seed, ctx.device)


def ranks_per_node(cfg: Config, world: int) -> int:
    """The ranks on one node: the launcher's local world size (torchrun), else the
    cluster file's devices per node (``parallel.cluster``), else all of them (one node)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local:
        return int(local)
    if cfg.parallel.cluster:
        return load_cluster(cfg.parallel.cluster).devices_per_node
    return world


def node_shard(cfg: Config, ctx: ParallelContext) -> Optional[NodeShard]:
    """ZeRO-3's node-local secondary shard (``parallel.zero_secondary=node``), or None.
    Collective (it makes the node groups) where asked."""
    if cfg.parallel.zero_secondary != "node":
        return None
    return NodeShard(*ctx.node_group(ranks_per_node(cfg, ctx.world_size)))


def build_train_state(cfg: Config, ctx: ParallelContext, model, tracker: TPRNGTracker,
                 zero_levels: Optional[list[int]] = None) -> TrainState:
    """The run's state around ``model`` (put in training mode): engine, optimizer,
    gradient reducer and (pp > 1) pipeline runner. Collective when pipelined (the runner
    creates groups).
    ``zero_levels``: a ZeRO level per block of ``model.blocks()`` and one more for the
    parameters outside every block (norm, head); default ``parallel.zero`` for all."""
    par = cfg.parallel
    model.train()
    group_of = grad_group_of(ctx, ctx.tp)
    prescale_of = None
    tied = (model.embed.wte.weight if ctx.tie_group is not None and cfg.model.tie_embeddings
            else None)
    tie_sync = None
    if tied is not None and ctx.layout.stages[0].tp != ctx.layout.stages[-1].tp:
        tie_sync = TiedTableSync(tied, ctx.tie_group, ctx.dp, ctx.tp_rank, cfg.model.vocab_size)
    elif tied is not None:  # summed over both stages' replicas (GradReducer's prescale)
        base = group_of
        group_of = lambda p: ctx.tie_group if p is tied else base(p)  # noqa: E731
        prescale_of = lambda p: 1.0 / ctx.dp if p is tied else None  # noqa: E731
    # after the DP reduction: the tied table's two copies, the replicated kv heads' rows
    kv_sum = ReplicaGradSum.for_model(model, kv_group_of(ctx, ctx.tp), ctx.tp)
    # sequence parallelism: the unsharded parameters' chunk terms, summed over TP
    seq_sum = SequenceGradSum.for_model(model, ctx.tp_group)
    syncs = [f for f in (tie_sync, kv_sum, seq_sum) if f is not None]
    # whether the run uses ZeRO anywhere: the same on every rank and stage (collectives)
    any_zero = bool(par.zero) or bool(zero_levels and any(zero_levels))
    if zero_levels is None:
        zero_levels = plan_zero_levels(cfg, ctx)
        any_zero = bool(par.zero) or plan_uses_zero(cfg)
    # the highest level some parameters allow: the tied table's group spans two stages
    # (replicated), the kv-replica and sequence sums need whole gradients (level 1 at most)
    cap = {id(p): 1 for ps in (kv_sum.params.values() if kv_sum else []) for p in ps}
    cap.update({id(p): 1 for _, ps in (seq_sum.params.values() if seq_sum else [])
                for p in ps})
    if tied is not None:
        cap[id(tied)] = 0
    level_of = zero_level_of(model, zero_levels, par.zero, cap)
    precision = resolve_precision(cfg.train.precision, ctx.device.type)
    tied_head = (cfg.model.tie_embeddings and model.head is None and model.is_first
                 and model.is_last)
    reducer = GradReducer(model, ctx.dp_group, par.dp_bucket_mb, group_of=group_of,
                          prescale_of=prescale_of, level_of=level_of,
                          then=(lambda: [f() for f in syncs]) if syncs else None,
                          tied_head=tied_head, prefetch=par.zero_prefetch,
                          zero=any_zero, reduce_dtype=REDUCE_DTYPES[par.grad_reduce_dtype],
                          gather_dtype=torch.bfloat16 if precision in BF16_PRECISIONS
                          else None, node=node_shard(cfg, ctx),
                          # bf16 weights over fp32 masters (bf16-autocast: fp32 weights)
                          master=precision == "bf16")
    opt = build_optimizer(model, cfg.train, ctx.device, reducer.ownership.optimizer_params(model))
    reducer.ownership.seed_optimizer(opt)
    chunks = None
    if model.chunks:  # an engine per chunk: its tracker, its blocks' indices in the model's
        rng = tracker
        tracker = rng.trackers[0]
        chunks = [Chunk(view, build_engine(par.schedule, ctx.tp_group, cfg.sub_batches,
                                           par.recompute, t, ShiftedParams.of(
                                               reducer.ownership.params, model, view)), c, rng)
                  for c, (view, t) in enumerate(zip(model.chunks, rng.trackers))]
    schedule = build_engine(par.schedule, ctx.tp_group, cfg.sub_batches, par.recompute,
                              tracker, params=reducer.ownership.params)
    pipe = PipelineRunner.from_config(ctx, cfg, chunks) if ctx.layout is not None else None
    return TrainState(cfg, ctx, model, opt, reducer, schedule, pipe)


def plan_zero_levels(cfg: Config, ctx: ParallelContext) -> Optional[list[int]]:
    """The plan file's per-block ZeRO levels for this rank's blocks (its stage's, when
    pipelined) and its head entry, or None (no plan, or no ``zero`` in it)."""
    path = cfg.parallel.plan
    if not path or path == "auto":
        return None
    zero = load_plan(path).zero
    if not zero:
        return None
    zero = check_zero(zero, cfg.model.n_layer, f"plan file {path}")
    if ctx.layout is None:
        return zero
    a, b = ctx.layout.stages[ctx.stage].layers
    return (zero[:1] if ctx.is_first_stage else []) + zero[1 + 2 * a: 1 + 2 * b] + \
        [zero[-1] if ctx.is_last_stage else 0]


def plan_uses_zero(cfg: Config) -> bool:
    """The plan file gives some block (of any stage) a ZeRO level above 0."""
    path = cfg.parallel.plan
    return bool(path) and path != "auto" and any(load_plan(path).zero)


def zero_level_of(model, levels: Optional[list[int]], default: int,
                  cap: Optional[dict[int, int]] = None):
    """param -> ZeRO level: its block's entry of ``levels`` (the last entry: parameters
    outside every block), else ``default``; at most ``cap[id(param)]``."""
    cap = cap or {}
    if not levels:
        return lambda p: min(default, cap.get(id(p), default))
    blocks = model.blocks()
    if len(levels) != len(blocks) + 1:
        raise ValueError(f"{len(levels)} ZeRO levels for {len(blocks)} blocks + head")
    of = {}
    for i, blk in enumerate(blocks):
        for p in blk.parameters():
            of.setdefault(id(p), levels[i])
    return lambda p: min(of.get(id(p), levels[-1]), cap.get(id(p), 3))


@torch.no_grad()
def fast_init(model) -> None:
    """Weights by each parameter's init rule, drawn on its device with torch's generator:
    for timing only (not oases' initialisation, which gives the same weights at every
    layout and draws on the host, slowly for a large model)."""
    for p in model.parameters():
        rule = p.init_rule
        if rule[0] == "normal":
            p.normal_(0.0, rule[1])
        else:
            p.fill_(1.0 if rule[0] == "ones" else 0.0)


class _FixedBatches:
    """One random micro-batch, over and over (timing only)."""

    masked = False  # random token ids: every target counts

    def __init__(self, cfg: Config) -> None:
        g = torch.Generator().manual_seed(cfg.seed)
        ids = torch.randint(0, cfg.model.vocab_size,
                            (cfg.train.micro_batch_size, cfg.model.seq_len + 1), generator=g)
        self.x, self.y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def next_batch(self):
        return self.x, self.y


class ThrowawayStep:
    """One real training step (``train_step``) of a throwaway model, fed one random
    micro-batch, each time it is called: what ``plan=auto``'s calibration and trials
    time. :meth:`close` frees the model (its gradient hooks would otherwise keep its
    parameters and buckets alive beside the real run's) and destroys the groups its build
    created (a pipeline runner's; collective: every rank closes it at the same point)."""

    def __init__(self, state: TrainState, batches: _FixedBatches,
                 groups: Optional[list] = None) -> None:
        self.state, self.batches = state, batches
        self.groups = groups if groups is not None else []

    def __call__(self) -> None:
        train_step(self.state, self.batches, self.state.cfg.train.lr)

    def close(self) -> None:
        self.state.reducer.close()
        self.state = None
        destroy_groups(self.groups)


def throwaway_step(cfg: Config, ctx: ParallelContext, degrees: Optional[list[int]],
                   fast: bool = False) -> ThrowawayStep:
    """A :class:`ThrowawayStep` with these per-block degrees. It draws random numbers:
    callers that must not be affected fork the random state (``resolve_plan`` does).
    ``fast``: weights drawn on the device (:func:`fast_init`), where only the time of a
    step matters. Collective: every rank builds it."""
    made: list = []
    with recording_groups(made):
        tracker = seed_tracker(cfg, ctx)
        model = build_rank_model(cfg, ctx, tracker, degrees, None if fast else cfg.seed)
        if fast:
            fast_init(model)
        state = build_train_state(cfg, ctx, model, tracker)
    # groups the context built on first use (its degree groups) are the context's
    own = [g for g in made if g not in ctx.groups]
    batches = _FixedBatches(cfg)  # whole rows; a cp rank keeps its chunks of them
    return ThrowawayStep(state, CpShards(batches, ctx.cp, ctx.cp_rank) if ctx.cp > 1
                         else batches, own)
