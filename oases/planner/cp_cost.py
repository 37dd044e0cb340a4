"""What context parallelism (``parallel.cp``) changes in a layout's price: the ring's
bytes per attention block and how much of them the ring's own compute hides. Pure
Python, no torch.

Under cp each rank holds T/cp tokens of every row (two head-tail chunks), so what a
rank computes and keeps scales by 1/cp: the block profile is rescaled as if it ran
1/cp of the rows (:func:`oases.planner.stages.scale_profile`; causal attention's FLOPs
per rank are 1/cp of the whole too, since every rank's queries meet half of every other
block), and the activation terms the cost model counts itself read T/cp tokens
(:attr:`oases.planner.cost.CostModel.tokens`). What cp adds is the ring of
:mod:`oases.parallel.ring_attention`, per attention block and sub-batch (B its rows,
Hkv the kv heads a rank holds at degree t, D the head dimension):

    kv block     (2, B, Hkv, T/cp, D) in the compute dtype        = K bytes
    accumulator  the same shape in fp32 (the dk/dv sums)           = A bytes
    forward      cp - 1 kv blocks sent                             (cp - 1) K
    backward     cp - 1 kv blocks again, cp accumulator hops       (cp - 1) K + cp A
    recompute    ``fine`` and ``full`` run the attention forward again in backward, ring
                 included: (cp - 1) K more

Each exchange sends to the next rank and receives from the previous one over the cp
group's ring: consecutive DP ranks at one TP position (:func:`oases.parallel.ranks.cp_specs`),
which span cp x tp consecutive ranks, so a ring stays inside a node where those fit
one, else crosses; its time is latency + bytes / (the slowest link of the slowest cp
ring), x_K and x_A.
The receive of step s + 1 is posted before step s's attention, so it hides behind
that step's attention compute a: with the attention core's share of the block
(:func:`core_share`) and 1/cp of it per step,

    forward   (cp - 1) max(0, x_K - a_f)
    backward  max(0, x_K - a_b) + (cp - 2) max(0, x_K + x_A - a_b) + max(0, x_A - a_b) + x_A

(backward step s has the next kv block and step s - 1's accumulator in flight; the
last hop home is waited at once), plus the host's per-call cost of each exchange
(``call_s``). Under the ``oases`` engine a ring step's wait is a yield point of its
sub-batch (:mod:`oases.overlap.block_programs`): the other n - 1 sub-batches compute
their own step meanwhile, so a is n times one sub-batch's step there. These waits
lengthen the block's compute in the cost model, so under the ``oases`` engine the other
sub-batch's TP collective still pairs with them.

Left out: the ring's kernels are priced as the profiled attention's (per-block kernels
and the log-sum-exp merge cost more: 2.1x SDPA's time on one H200,
benchmarks/results/ring-cuda-nvidia-h200.md); the host cycles the ring's bytes take on
CPU ranks (``cpu_per_byte`` is the TP collectives'); that the other sub-batches' turn
at a ring wait may be another segment than their own ring step (a TP collective's
partner, a combine); cp rings of one node sharing its links; the ring's transient buffers (two kv blocks, and
in backward two fp32 accumulators); and where the profiled attention kept T^2 scores
(the math kernel) the ring keeps one block's at a time: the memory row is then an upper
bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from oases.parallel.ranks import cp_specs

ACC_BYTES = 4  # dk/dv accumulators travel in fp32 (oases.parallel.ring_attention)
# The fewest tokens of a head-tail chunk (T / 2cp) the search splits a sequence into: a
# flash kernel's tile. Below it a rank's attention costs about a tile's whatever its
# tokens, and every ring step's launches stay, while this model prices compute in
# proportion to the tokens and no step's fixed cost: it would pick cp where cp loses.
MIN_CHUNK = 128


def kv_heads_at(shape, t: int) -> int:
    """kv heads a rank holds at degree t: split, or one whole head replicated above
    ``n_kv_heads`` ranks (oases.config.heads)."""
    return max(1, shape.n_kv_heads // t)


def core_share(shape) -> float:
    """The attention core's share of an attention block's compute: per token its score
    and value matmuls take about 2 seq d FLOPs (causal), the linears 2M (M the block's
    matrix parameters), forward and backward alike (the ratio of
    :meth:`oases.planner.cost.CostModel.wgrad_share`); cp leaves it as it is."""
    core = shape.seq_len * shape.d_model
    return core / (shape.matrix_params("attn") + core)


def ring_groups(dp: int, tp: int, cp: int) -> list[list[int]]:
    """The cp groups of one stage of ``dp`` (every replica, cp ranks included) x ``tp``
    ranks, numbered from 0 as a stage's cost model numbers them."""
    return [list(g.ranks) for g in cp_specs(0, 0, dp, tp, cp)]


@dataclass(frozen=True)
class Ring:
    """One attention block's ring, per sub-batch: message sizes and their times."""

    cp: int
    kv_bytes: float   # one kv block, K
    acc_bytes: float  # one accumulator hop, A
    kv_s: float       # x_K: one kv block on the ring's slowest link
    acc_s: float      # x_A
    call_s: float     # the host's cost of one exchange

    def sent(self) -> tuple[float, float]:
        """(forward, backward) bytes a rank sends (and receives) per sub-batch; a
        recompute of the forward sends the forward's again."""
        n = self.cp
        return (n - 1) * self.kv_bytes, (n - 1) * self.kv_bytes + n * self.acc_bytes

    def exposed(self, attend_f: float, attend_b: float) -> tuple[float, float]:
        """(forward, backward) seconds the ring adds to one sub-batch's attention block,
        whose attention takes ``attend_f``/``attend_b`` per ring step (module
        docstring)."""
        n, x, a = self.cp, self.kv_s, self.acc_s
        fwd = (n - 1) * (max(0.0, x - attend_f) + self.call_s)
        bwd = (max(0.0, x - attend_b) + (n - 2) * max(0.0, x + a - attend_b)
               + max(0.0, a - attend_b) + a + (2 * n - 1) * self.call_s)
        return fwd, bwd


def ring_of(cm, t: int) -> Ring:
    """The ring of an attention block at degree t in the cost model ``cm`` (its run's
    cp > 1): ``cm.rows(t)`` rows per sub-batch, the run's compute dtype, the cp rings
    of its stage on ``cm.cluster``'s links."""
    s, run = cm.shape, cm.run
    elems = 2 * cm.rows(t) * kv_heads_at(s, t) * cm.tokens * (s.d_model // s.n_head)
    kv, acc = elems * run.act_bytes, elems * ACC_BYTES
    groups = ring_groups(run.dp, run.tp, run.cp)
    bps = min(cm.cluster.ring_gbps(g) for g in groups) * 1e9 / 8
    lat = max(cm.cluster.latency_s(g) for g in groups)
    return Ring(run.cp, kv, acc, lat + kv / bps, lat + acc / bps, cm.call_s)


def ring_exposed(cm, kind: str, t: int) -> tuple[float, float]:
    """(forward, backward) seconds the ring adds to one sub-batch of block ``kind`` at
    degree t: 0 but for attention under cp. The attention per ring step is the core's
    share of the block's profiled time (already at T/cp tokens) over cp steps, times the
    sub-batches that compute while one waits (all of them under ``oases``)."""
    if kind != "attn" or cm.run.cp < 2:
        return 0.0, 0.0
    prof = cm.profile.blocks[kind][str(t)]
    turns = cm.run.sub_batches if cm.run.schedule == "oases" else 1
    per_step = turns * core_share(cm.shape) / cm.run.cp
    return ring_of(cm, t).exposed(per_step * prof["fwd"], per_step * prof["bwd"])
