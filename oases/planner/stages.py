"""Pipeline planning problems from a profile and a cluster file (planner v2). Pure Python.

An *outer choice* fixes what AMP enumerates: ``pp`` stages of ``dp x tp`` ranks
each (the same mesh on every stage; stage p owns ranks ``p*world/pp ..``, as in
:mod:`oases.parallel.layout`) and ``c`` micro-batches per step. The config's global batch
B is kept, so a replica runs ``R = B / (c dp)`` sequences per micro-batch. For one
choice :func:`build` makes a :class:`oases.planner.uniap.Instance`:

* MILP *layers* are transformer layers, not blocks: the runtime cuts stages between
  layers (a plan's stages are layer ranges), and with one strategy per layer the
  MILP has ``2 L P S^2`` pair variables (per block: twice as many, and cuts inside
  a layer that no runtime stage can express).
* strategy s = a TP degree d_s dividing tp (powers of two the heads and ffn width
  allow, and whose batch parts hold whole sequences): both blocks of the layer run
  at d_s on tp/d_s replicas inside the TP group (a per-layer DP x TP mix, which the
  runtime runs as the stage's per-block ``degrees``).

Every number comes from the overlap-aware :class:`CostModel` of the stage, built
for ONE micro-batch (``grad_accum=1``), on the stage's own links (:class:`StageLinks`
renumbers its ranks) and at the speed of its slowest node (the cost model asks
``cluster.speed_of`` for the stage's global ranks); its memory limit is its
smallest node's less a headroom (``cluster.plan_bytes_of``). The cost model's step is a chain of
node costs (one block at its degree) and edge costs (two neighbouring blocks: under
``oases`` the pairing of one block's compute with the other's collective, plus
resharding). An edge
between layers l-1 and l is cut in two when a stage boundary falls there:

    edge(mlp_{l-1} r -> attn_l s) = cf(attn_l, s) + cb(mlp_{l-1}, r) + extra(r, s)

The two computes run whether or not l-1 and l share a stage (without a partner
they run alone), so they are charged to their own layers in ``t``; ``extra`` (what
the pairing and the resharding add, >= 0) is ``e``. Hence, per micro-batch:

    t[p][l][s] = node(attn_l, s) + edge(attn_l -> mlp_l, s, s) + node(mlp_l, s)
                 + cf(attn_l, s) [l > 0] + cb(mlp_l, s) [l < L-1]      (oases only)
                 + (grad sync of both blocks at s) / c
                 + embedding/head/loss compute                       [l = L-1]
    e[p][l][r][s] = extra(r, s)
    x[p][l][r][s] = 2 B/c rows of activations (forward, and its gradient back) over
                    the slowest link between stages p and p+1, + the all-gather of
                    l-1's output from degree r to tp and of l's input from tp to s
    m[p][l][s]   = weights, gradients and Adam state of both blocks at s
    a[p][l][s]   = activations both blocks keep for one micro-batch in flight
    w[p][l][s]   = (zero-bubble schedules) the W part of t: both blocks' linear dW
                   (:meth:`CostModel.wgrad_time`)
    b[p][l][s]   = (zero-bubble schedules) what one pending W keeps: the linears' X and
                   dY (:meth:`CostModel.wgrad_bytes`)

Under context parallelism (``Choice.cp`` > 1: each replica's rows over cp ranks, T/cp
tokens each) a stage's cost model runs 1/cp of every row and prices the ring
(:mod:`oases.planner.cp_cost`); its one strategy is tp.

The pipeline schedule (``parallel.pp_schedule``) sets how these make a time and memory
rows (:mod:`oases.planner.pipe_cost`); :func:`with_schedule` re-prices a built choice
under another schedule without rebuilding its stages.

The embedding goes with stage 0, the head and the loss with the last stage: their
compute is charged to layer L-1 (always on the last stage; the embedding lookup
is negligible beside the head's matmul), their memory is taken off the stages'
limits, with the largest graph rebuilt during backward (the transient peak).

Gradient synchronisation (over dp and a block's replicas, plus replicated kv
heads) happens once per step. It is folded into ``t`` as ``sync / c``: in UniAP's
time per iteration (every stage once, the slowest c - 1 more times) the slowest
stage then pays its sync exactly once and the others 1/c of theirs, which keeps
the objective linear. The reducer launches a block's sync as soon as the last
micro-batch's backward has made its gradients, so it hides behind the backward
still to run; per layer, ``sync`` is what outlasts that layer's own backward of
one micro-batch, ``max(0, sync_l - bwd_l)`` (the pp = 1 ILP of ``tp-only`` models
the queue exactly, a max of sums; per layer it stays linear). A stage after the
first also has the earlier stages' cool-down to hide behind, which this ignores.

The profile is measured once (:func:`profile_run`: degrees up to the largest tp
searched, rows at which every degree holds whole sequences) and rescaled per
choice: a block's compute and its activation bytes are linear in the rows it
runs (seq fixed), affine where the profiler measured two row counts (a small
model's kernels have a fixed cost), the head's in rows x vocab / tp, the
optimizer step in the parameters a rank holds (:func:`scale_profile`). Every
collective call (TP and resharding collectives, pipeline transfers, gradient
syncs) adds the profile's measured per-call cost. ``parallel.overlap_fb`` (a
backward paired with the next forward) is not modelled here: every micro-batch is
priced on its own.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from oases.config.layout_checks import cp_needs
from oases.errors import ConfigError
from oases.parallel.layout import even_split
from oases.pipeline.schedules import SPLIT_KINDS, VIRTUAL_KINDS
from oases.planner.comm_memory import choice_bytes
from oases.planner.cp_cost import MIN_CHUNK
from oases.planner import zero_cost
from oases.planner.cost import (PARAM_BYTES, CostModel, ModelShape, Profile,
                                RunShape)
from oases.planner.cluster import StageLinks
from oases.planner.profile import run_precision
from oases.config.schema import BF16_PRECISIONS
from oases.planner.uniap import Instance, evaluate


@dataclass(frozen=True)
class Job:
    """What the config fixes for every choice."""

    shape: ModelShape
    global_batch: int          # sequences per optimizer step
    sub_batches: int
    schedule: str              # "oases" | "megatron"
    recompute: str
    pp_schedule: str = "1f1b"  # one of oases.pipeline.schedules.KINDS
    pp_transfer: str = "broadcast"
    act_bytes: int = 4
    residual_bytes: int = 4
    sequence_parallel: bool = False  # then only a tp that divides the sequence
    pp_virtual: int = 1        # chunks per rank under interleaved-1f1b
    grad_reduce_bytes: int = 4  # parallel.grad_reduce_dtype: 4 fp32, 2 bf16
    cp_search: bool = False    # layouts with context parallelism too (the config allows it)
    weight_bytes: int = 4      # 2: bf16 weights over fp32 masters (train.precision=bf16)
    # ZeRO levels, gradient-sum bytes and secondary shard ("none" | "node" | "search") each
    # layout is priced with (parallel.zero_search: all of them, the cheapest that fits)
    zero_levels: tuple = (0,)
    reduce_options: tuple = (4,)
    secondary: str = "none"
    node_ranks: int = 0        # devices per node (the cluster file's): where a DP group spans

    @property
    def splits(self) -> int:
        """Parts a replica's micro-batch is cut into before any degree splits it."""
        return self.sub_batches if self.schedule == "oases" else 1

    def run(self, tp: int, dp: int, rows: int, cp: int = 1) -> RunShape:
        """One micro-batch of ``rows`` per data replica (``dp`` of them, each of ``cp``
        ranks: the run's dp counts every replica of the parameters)."""
        return RunShape(tp=tp, dp=dp * cp, micro_batch_size=rows, grad_accum=1, cp=cp,
                        sub_batches=self.sub_batches, schedule=self.schedule,
                        recompute=self.recompute, act_bytes=self.act_bytes,
                        residual_bytes=self.residual_bytes,
                        sequence_parallel=self.sequence_parallel,
                        grad_reduce_bytes=self.grad_reduce_bytes, weight_bytes=self.weight_bytes)


def job_from_config(cfg, node_ranks: int = 0) -> Job:
    """The :class:`Job` of a validated config (``node_ranks``: the cluster's devices per
    node, for the secondary shard)."""
    p = cfg.parallel
    reduce = {"fp32": (4,), "bf16": (2,), "auto": (4, 2)}[p.grad_reduce_dtype]
    return Job(ModelShape.from_config(cfg.model), cfg.global_batch_size, cfg.sub_batches,
               p.schedule, p.recompute, p.pp_schedule, p.pp_transfer,
               2 if run_precision(cfg) in BF16_PRECISIONS else 4,
               sequence_parallel=p.sequence_parallel, pp_virtual=p.pp_virtual,
               grad_reduce_bytes=reduce[0], cp_search=cp_allowed(cfg),
               weight_bytes=2 if run_precision(cfg) == "bf16" else 4,
               # bf16 weights: the embedding's output, hence the residual stream, is bf16
               residual_bytes=2 if run_precision(cfg) == "bf16" else 4,
               zero_levels=(0, 1, 2, 3) if p.zero_search else (p.zero,), reduce_options=reduce,
               secondary="search" if p.zero_search else p.zero_secondary,
               node_ranks=node_ranks)


def cp_allowed(cfg) -> bool:
    """Whether the config lets the search split sequences (what cp needs of the model and
    the run, :func:`oases.config.layout_checks.cp_needs`, at the smallest degree; larger
    ones are checked against ``model.seq_len`` as they are enumerated)."""
    try:
        cp_needs(cfg, 2)
    except ConfigError:
        return False
    return True


def profile_run(job: Job, tp_max: int, micro_batch_size: int) -> RunShape:
    """The run to profile at: degrees up to ``tp_max``, and a micro-batch (the config's,
    rounded up) that every degree cuts into whole sequences."""
    unit = job.sub_batches * tp_max
    rows = unit * max(1, math.ceil(micro_batch_size / unit))
    return job.run(tp_max, 1, rows)


@dataclass(frozen=True)
class Choice:
    pp: int
    dp: int
    tp: int
    micro_batches: int         # c
    rows: int                  # sequences per replica per micro-batch: B / (c dp)
    degrees: tuple             # the strategies: per-layer TP degrees
    cp: int = 1                # each of the dp replicas on cp ranks (T / cp tokens each)
    zero: int = 0              # ZeRO level, L of its secondary shard, gradient-sum bytes
    secondary: int = 0
    reduce_bytes: int = 4

    @property
    def mesh_dp(self) -> int:
        """A stage's replicas of the parameters, as its mesh counts them: dp x cp."""
        return self.dp * self.cp

    def label(self) -> str:
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        z = f" zero={self.zero}{'+node' if self.secondary else ''}" if self.zero else ""
        r = " reduce=bf16" if self.reduce_bytes == 2 else ""
        return f"pp={self.pp} dp={self.dp}{cp} tp={self.tp} c={self.micro_batches}{z}{r}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_choices(job: Job, world: int, max_tp: Optional[int] = None) -> list[Choice]:
    """Every (pp, dp, cp, tp, c) the runtime can run with the config's global batch: pp
    divides the world and is at most the layer count; tp a power of two the heads and
    ffn width allow; cp (with ``job.cp_search``) a power of two (:func:`cp_degrees`);
    c divides the per-replica batch into micro-batches that split into
    the sub-batches; 1F1B needs c >= pp. A choice's strategies are the degrees whose
    batch parts hold whole sequences; under cp, tp alone (the ring runs no per-block
    degrees). A cp choice whose replica's rows split into cp x the sub-batches is left
    out: cp x the replicas at cp 1 run the same tokens per rank (the same compute,
    collectives and memory) without the ring, so cp pays where the rows cannot be
    split further (long sequences, few of them)."""
    out = []
    for pp in _divisors(world):
        if pp > job.shape.n_layer:
            continue
        per = world // pp
        for tp in job.shape.valid_degrees(per):
            if (max_tp and tp > max_tp) or (job.sequence_parallel and job.shape.seq_len % tp):
                continue
            for cp in cp_degrees(job, per // tp):
                dp = per // (tp * cp)
                if job.global_batch % dp:
                    continue
                for c in _divisors(job.global_batch // dp):
                    rows = job.global_batch // (dp * c)
                    if rows % job.splits or (pp > 1 and job.pp_schedule != "gpipe" and c < pp):
                        continue
                    if pp > 1 and job.pp_virtual > 1 and c % pp:  # Megatron's groups of pp
                        continue
                    if cp > 1 and rows % (cp * job.splits) == 0:  # dominated (docstring)
                        continue
                    degrees = (tp,) if cp > 1 else tuple(
                        t for t in job.shape.valid_degrees(tp)
                        if (rows // job.splits) % (tp // t) == 0)
                    out += [Choice(pp, dp, tp, c, rows, degrees, cp, z, L, r)
                            for z, L, r in zero_cost.zero_variants(
                                job.zero_levels, job.reduce_options, job.secondary,
                                job.node_ranks, dp * cp, tp)]
    return out


def cp_degrees(job: Job, ranks: int) -> list[int]:
    """1, and with ``job.cp_search`` (never with sequence parallelism: the cost model does
    not price the two together) every power of two cp dividing a stage's ``ranks`` / tp whose 2 cp
    head-tail chunks split the sequence evenly into at least
    :data:`oases.planner.cp_cost.MIN_CHUNK` tokens each."""
    out, cp, seq = [1], 2, job.shape.seq_len
    while job.cp_search and not job.sequence_parallel and cp <= ranks \
            and seq >= 2 * cp * MIN_CHUNK:
        if ranks % cp == 0 and seq % (2 * cp) == 0:
            out.append(cp)
        cp *= 2
    return out


def scale_profile(profile: Profile, base: RunShape, run: RunShape, shape: ModelShape
                  ) -> Profile:
    """``profile`` (taken at ``base``) for ``run``'s rows per degree. A block at degree
    t runs ``mbs / sub * t / tp`` rows (``sub`` sub-batches): the ratio to the base is
    the same at every degree, and the block's fixed part (launches, Python) is paid per
    sub-batch whatever its rows (:func:`at_rows`). Saved bytes: the weights' part
    (:meth:`CostModel.weight_bytes`) is fixed, the rest scales with the rows."""
    # under cp a rank runs 1/cp of each row's tokens: as 1/cp of the rows (cp_cost)
    rows = (run.micro_batch_size / run.sub_batches / run.tp / run.cp) / \
        (base.micro_batch_size / base.sub_batches / base.tp / base.cp)
    head = (run.micro_batch_size / base.micro_batch_size) * (base.tp / run.tp) * \
        (base.cp / run.cp)
    blocks: dict = {}
    for kind, per_degree in profile.blocks.items():
        blocks[kind] = {}
        for t, e in per_degree.items():
            w = run.act_bytes * shape.matrix_params(kind) / int(t) + \
                PARAM_BYTES * shape.norm_params(kind)
            blocks[kind][t] = dict(e, fwd=at_rows(e, "fwd", rows), bwd=at_rows(e, "bwd", rows),
                                   saved=w + max(0.0, e["saved"] - w) * rows)
    const = dict(profile.constant)
    for k in ("fwd", "bwd", "head_fwd", "embed_bwd"):
        if k in const:  # per micro-batch, the last two per sub-batch
            const[k] = const[k] * head * (base.sub_batches / run.sub_batches
                                          if k in ("head_fwd", "embed_bwd") else 1)
    if "peak" in const:
        const["peak"] = const["peak"] * head
    const["step"] = 0.0  # per stage, see Problem.constant
    return Profile(blocks, const, profile.comm)


def at_rows(e: dict, phase: str, ratio: float) -> float:
    """A block's ``phase`` time at ``ratio`` x its profiled rows: ``a + b * rows``
    through the profile's two measurements (``rows``, and ``rows2`` where the profiler
    took it), else proportional. Both coefficients are kept >= 0 (noise can put the
    second point below the first, or beyond proportional)."""
    if "rows2" not in e or e["rows2"] == e.get("rows"):
        return e[phase] * ratio
    r1, r2, y1, y2 = e["rows"], e["rows2"], e[phase], e[phase + "2"]
    b = max(0.0, (y2 - y1) / (r2 - r1))
    if y1 - b * r1 < 0:  # growing faster than the rows: proportional, as one point says
        return y1 * ratio
    return y1 - b * r1 + b * r1 * ratio


# ---- one choice -> one Instance ----

@dataclass
class Problem:
    """One outer choice's MILP instance and what turns its answers into plans."""

    choice: Choice
    inst: Instance
    constant: float                 # per step, outside the instance: the optimizer step
    memory_const: list[float]       # per stage, bytes: embedding/head, transient peak
    models: list[CostModel] = field(repr=False)
    tp_index: Optional[int] = None  # the strategy "every layer at degree tp"

    def time(self, starts, strat) -> float:
        return evaluate(self.inst, starts, strat)[0] + self.constant

    def memory(self, starts, strat) -> list[float]:
        return [m + k for m, k in zip(evaluate(self.inst, starts, strat)[1], self.memory_const)]


def _stage_model(job: Job, ch: Choice, cluster, profile: Profile, base: RunShape,
                 first: int) -> CostModel:
    run = dataclasses.replace(job.run(ch.tp, ch.dp, ch.rows, ch.cp), zero=ch.zero,
                              secondary=ch.secondary, grad_reduce_bytes=ch.reduce_bytes)
    return CostModel(job.shape, run, StageLinks(cluster, first),
                     scale_profile(profile, base, run, job.shape), list(ch.degrees),
                     ranks=list(range(first, first + ch.mesh_dp * ch.tp)))


def _layer_row(cm: CostModel, job: Job, ch: Choice, l: int) -> list[float]:
    """t[p][l][.] of the module docstring, for layer l (only l = 0, l = L-1 differ)."""
    L, oases = job.shape.n_layer, job.schedule == "oases"
    row = []
    for d in ch.degrees:
        cost = 0.0
        sync = max(0.0, sum(cm.sync[k, d] - cm.free[k, d] for k in ("attn", "mlp")))
        for i, k in ((2 * l, "attn"), (2 * l + 1, "mlp")):
            once = cm.step_once(k, d)  # per step: below
            cost += cm.node_cost(i, d) - once + once / ch.micro_batches
        cost += sync / ch.micro_batches
        cost += cm.edge_cost(2 * l + 1, d, d)
        if oases and l > 0:
            cost += cm.cf["attn", d]
        if oases and l < L - 1:
            cost += cm.cb["mlp", d]
        if l == L - 1:
            cost += cm.constant_time()  # embedding/head/loss per micro-batch (step is 0)
        row.append(cost)
    return row


def _extra(cm: CostModel, job: Job, ch: Choice, l: int) -> list[list[float]]:
    """e[p][l][r][s]: the edge between layer l-1 (degree r) and l (s) beyond its two
    computes (which t charges)."""
    out = []
    for r in ch.degrees:
        row = []
        for s in ch.degrees:
            e = cm.edge_cost(2 * l, r, s)
            if job.schedule == "oases":
                e -= cm.cf["attn", s] + cm.cb["mlp", r]
            row.append(max(0.0, e))
        out.append(row)
    return out


def _link(cluster, a: range, b: range) -> tuple[float, float]:
    """(Gbit/s of the slowest link between two rank sets, latency in s)."""
    gbps = min(cluster.link_gbps(i, j) for i in a for j in b)
    return gbps, cluster.latency_s(list(a) + list(b))


def _transfer(job: Job, ch: Choice, cluster, src: range, dst: range) -> float:
    """One micro-batch's activation to the next stage and its gradient back: every
    byte of the pipeline micro-batch crosses once (``pp_transfer=send``: once per
    receiving TP rank), over the slowest link between the stages, in the compute dtype
    (the wire dtype: bf16 under bf16, ``oases.parallel.wire``)."""
    gbps, lat = _link(cluster, src, dst)
    nbytes = ch.rows * ch.dp * job.shape.seq_len * job.shape.d_model * job.act_bytes
    if job.pp_transfer == "send":
        nbytes *= ch.tp
    return 2 * (lat + nbytes / (gbps * 1e9 / 8))


def _memory_const(job: Job, ch: Choice, cms: list[CostModel]) -> list[float]:
    """Per stage: the embedding (stage 0), final norm, head (a tied head keeps its own
    copy of the table on the last stage of a pipeline), the head's bf16 copy and
    the logits' peak (last stage), and the largest graph rebuilt in backward."""
    s, P, tp = job.shape, ch.pp, ch.tp
    d = s.d_model
    embed = s.embed_params()
    head = s.final_norm_params()
    if not s.tie_embeddings or P > 1:
        head += s.vocab_size * d
    out = []
    for p, cm in enumerate(cms):
        mem = max(cm.trans[k, t] for k in ("attn", "mlp") for t in ch.degrees)
        held = zero_cost.held_per_param(cm.run, cm.run.dp)  # 16 B at level 0 in fp32
        if p == 0:
            mem += held * embed / tp
        if p == P - 1:
            mem += held * head / tp + cm.profile.constant.get("peak", 0.0)
            if job.act_bytes < job.weight_bytes:
                mem += job.act_bytes * s.vocab_size * d / tp
        out.append(mem)
    return out


def build(job: Job, ch: Choice, cluster, profile: Profile, base: RunShape,
          memory_limit: Optional[float] = None) -> Problem:
    """The :class:`Problem` of one choice on ``cluster`` (world = pp x dp x cp x tp ranks).
    ``memory_limit`` (bytes per device) overrides the cluster's (its devices' memory less
    the headroom of :func:`oases.planner.cluster.usable_bytes` and the communicators of
    :func:`oases.planner.comm_memory.choice_bytes`)."""
    L, P = job.shape.n_layer, ch.pp
    missing = [f"{k} at degree {t}" for k in ("attn", "mlp") for t in ch.degrees
               if str(t) not in profile.blocks.get(k, {})]
    if missing:
        raise ConfigError(f"the profile has no figures for {', '.join(missing)}")
    size = ch.mesh_dp * ch.tp
    ranks = [range(p * size, (p + 1) * size) for p in range(P)]
    cms = [_stage_model(job, ch, cluster, profile, base, r.start) for r in ranks]
    t, e, m, a = [], [], [], []
    for cm in cms:
        rows = {l: _layer_row(cm, job, ch, l) for l in {0, min(1, L - 1), L - 1}}
        t.append([rows[l if l in rows else 1] for l in range(L)])
        mid = _extra(cm, job, ch, 1) if L > 1 else None
        e.append([mid] * L if mid else [[[0.0] * len(ch.degrees)] * len(ch.degrees)])
        stat = [sum(cm.mem[k, d] - cm.run.sub_batches * cm.saved_bytes(k, d)
                    for k in ("attn", "mlp")) for d in ch.degrees]
        act = [sum(cm.run.sub_batches * cm.saved_bytes(k, d) for k in ("attn", "mlp"))
               for d in ch.degrees]
        m.append([stat] * L)
        a.append([act] * L)
    x = []
    for p in range(P - 1):
        # the activation and its gradient: two calls of the step's per-call cost
        move = _transfer(job, ch, cluster, ranks[p], ranks[p + 1]) + 2 * cms[p].call_s
        tp = ch.tp
        x.append([[[move + cms[p].reshard_cost(0, r, tp) + cms[p + 1].reshard_cost(0, tp, s)
                    for s in ch.degrees] for r in ch.degrees]] * L)
    const = _memory_const(job, ch, cms)
    comms = choice_bytes(job, ch, cluster)  # NCCL communicators, off a derived limit only
    limits = [(memory_limit if memory_limit is not None else cluster.plan_bytes_of(r) - c) - k
              for r, k, c in zip(ranks, const, comms)]
    inst = Instance([f"tp{d}" for d in ch.degrees], P, ch.micro_batches, t, m, a, limits,
                    e=e, x=x or None, **_schedule_fields(job, ch, cms))
    # the optimizer steps of the stages run side by side: the slowest node's sets it
    step = profile.constant.get("step", 0.0) * base.tp / (ch.tp * P) / \
        cluster.speed_of(range(P * size))
    tp_index = ch.degrees.index(ch.tp) if ch.tp in ch.degrees else None
    return Problem(ch, inst, step, const, cms, tp_index)


def _schedule_fields(job: Job, ch: Choice, cms: list[CostModel]) -> dict:
    """The :class:`Instance` fields the pipeline schedule sets: its name, the chunks per
    rank, and under a zero-bubble kind each layer's W time and pending-W bytes (one
    micro-batch, both blocks). A single stage runs no pipeline schedule."""
    if ch.pp == 1:
        return dict(schedule="1f1b")
    out = dict(schedule=job.pp_schedule,
               virtual=job.pp_virtual if job.pp_schedule in VIRTUAL_KINDS else 1)
    if job.pp_schedule in SPLIT_KINDS:
        L = job.shape.n_layer
        out["wgrad"] = [[[sum(cm.wgrad_time(k, d) for k in ("attn", "mlp"))
                          for d in ch.degrees]] * L for cm in cms]
        out["stash"] = [[[sum(cm.wgrad_bytes(k, d) for k in ("attn", "mlp"))
                          for d in ch.degrees]] * L for cm in cms]
    return out


def with_schedule(prob: Problem, job: Job) -> Problem:
    """``prob`` (one choice, built for another schedule) priced under ``job``'s
    ``pp_schedule``: the stages' t, m, a, e, x do not depend on it."""
    i = prob.inst
    inst = Instance(i.strategies, i.stages, i.micro_batches, i.t, i.m, i.a, i.memory_limit,
                    e=i.e, x=i.x if i.stages > 1 else None,
                    **_schedule_fields(job, prob.choice, prob.models))
    return Problem(prob.choice, inst, prob.constant, prob.memory_const, prob.models,
                   prob.tp_index)


def even_starts(n_layer: int, pp: int) -> list[int]:
    """First layer of each stage in the runtime's default split."""
    return [a for a, _ in even_split(n_layer, pp)]
