"""Per-block TP degrees: the process groups and the resharding between degrees.

Let tp be the TP group size and t a degree dividing tp. A block of degree t runs
on tp/t *subgroups* of t contiguous ranks; subgroup g processes part g of the
(sub-)batch, split into tp/t parts along the batch dimension. Inside one TP group
(ranks 0..tp-1 of a DP replica), rank r at degree t is in subgroup r // t, at
position r % t, and holds batch part r // t:

    tp = 4     degree 4: {0 1 2 3} whole batch
              degree 2: {0 1} part 0 of 2     {2 3} part 1 of 2
              degree 1: {0} {1} {2} {3}       part r of 4

Between blocks of degrees t_a and t_b (k = ratio of the larger to the smaller):

* the degree drops (t_b < t_a): each rank keeps piece (r // t_b) % k of its
  batch part -- a slice, no communication. Backward all-gathers the gradient.
* the degree grows (t_b > t_a): the k ranks {same t_b subgroup, same r % t_a}
  all-gather their parts. Backward keeps this rank's piece.

Under sequence parallelism a rank holds its chunk of its batch part's sequences: a
transition gathers the chunks over the t_a subgroup first and keeps this rank's chunk
at t_b last (:meth:`DegreeGroups.reshard`), one all-gather more each way.

Either way the pieces are exchanged inside the *reshard group* of (t_small,
t_big): the ranks r' in this rank's t_big subgroup with r' = r mod t_small,
ordered by rank, which is exactly the order of the batch pieces.

The weights of a degree-t block are replicated over the tp/t subgroups, each of
which saw a different batch part: their gradients are *summed* over those
replicas and averaged over DP, in one all-reduce over the *gradient group*
{d*tp + g*t + j : all DP replicas d, all subgroups g} of this rank's position j.

Each degree has its own GQA layout (oases.config.heads): an attention block of degree
t > n_kv_heads replicates each kv head on t / n_kv_heads consecutive ranks of its
subgroup, whose kv gradients are summed over that *kv replica group* (at degree tp
the context's; ``kv[t]`` here, built by the same rank formula,
oases.parallel.ranks.kv_replica_ranks):

    tp = 4, n_kv_heads 2:   degree 4: kv replicas {0 1} {2 3}     degree 2, 1: none
    tp = 4, n_kv_heads 1:   degree 4: {0 1 2 3}   degree 2: {0 1} {2 3}
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from oases.parallel.comm import gather_from_tp, scatter_to_tp
from oases.parallel.ranks import create_groups, degree_specs
from oases.parallel.sequence import seq_gather, seq_split


def divisors_pow2(tp: int) -> list[int]:
    """The degrees a block may take: powers of two dividing tp."""
    return [t for t in (2 ** i for i in range(tp.bit_length())) if tp % t == 0]


class DegreeGroups:
    """All process groups for per-block degrees. Built collectively: every rank
    creates every group in the same order (``new_group`` is collective), from
    :func:`oases.parallel.ranks.degree_specs`. A group over the same ranks as another is
    that one (e.g. the (1, tp) resharding group is the TP group, the (1, t) one the
    degree-t subgroup): :func:`oases.parallel.ranks.new_group` shares it."""

    def __init__(self, rank: int, world: int, tp: int, dp: int, tp_group, dp_group,
                 base: int = 0, kv_heads: Optional[int] = None, kv_group=None) -> None:
        """``base``: the first global rank of the ranks these groups cover (a pipeline
        stage's; ranks outside ``base .. base + dp*tp - 1`` only take part in creating them).
        ``kv_heads``: the model's, for the kv replica groups; ``kv_group``: this rank's at
        degree tp (the context builds it)."""
        self.tp, self.dp, self.rank = tp, dp, rank
        self.degrees = divisors_pow2(tp)
        d_idx, r = divmod(rank - base, tp)
        self.tp_rank = r
        self.sub: dict[int, Optional[dist.ProcessGroup]] = {tp: tp_group, 1: None}
        self._reshard: dict[tuple[int, int], Optional[dist.ProcessGroup]] = {}
        self.grad: dict[int, Optional[dist.ProcessGroup]] = {tp: dp_group}
        self.kv: dict[int, Optional[dist.ProcessGroup]] = {tp: kv_group}
        self.kv.update({t: None for t in self.degrees if t < tp})
        mine = create_groups(rank, degree_specs(base, dp, tp, kv_heads))
        table = {"sub": self.sub, "reshard": self._reshard, "grad": self.grad, "kv": self.kv}
        for (role, key), g in mine.items():
            table[role][key] = g

    def position(self, t: int) -> tuple[int, int]:
        """(subgroup index = batch part, position in the subgroup) at degree t."""
        return divmod(self.tp_rank, t)

    def reshard_group(self, t_from: int, t_to: int):
        return self._reshard[(min(t_from, t_to), max(t_from, t_to))]

    def piece(self, t_from: int, t_to: int) -> tuple[int, int]:
        """(this rank's piece index, number of pieces) of a transition."""
        small, big = min(t_from, t_to), max(t_from, t_to)
        return (self.tp_rank // small) % (big // small), big // small

    def reshard(self, x: torch.Tensor, t_from: int, t_to: int,
                sequence_parallel: bool = False) -> torch.Tensor:
        """Autograd-aware transition of a (batch, ...) activation between degrees. Under
        ``sequence_parallel`` ``x`` is this rank's sequence chunk: the chunks of the
        degree-``t_from`` subgroup are gathered first and this rank's chunk of the
        degree-``t_to`` part kept last (backward: the conjugates)."""
        if t_from == t_to:
            return x
        if sequence_parallel:
            x = seq_gather(x, self.sub[t_from])
            return seq_split(self.reshard(x, t_from, t_to), self.sub[t_to])  # a fresh copy
        group = self.reshard_group(t_from, t_to)
        if t_to < t_from:
            # slice; backward all-gathers. A batch slice is a view: saved by the next block,
            # it would keep the whole batch's activation alive, where the planner's memory
            # model (a block profiled on its own rows) counts this piece only. Copy it.
            return scatter_to_tp(x, group, dim=0).clone()
        return gather_from_tp(x, group, dim=0)       # all-gather; backward slices


def grad_group_of(ctx, tp: int):
    """For GradReducer: the group a parameter's gradient is summed over, from the
    degree of the block that owns it (``param.tp_degree``)."""
    dg = ctx.built_degree_groups

    def group_of(p):
        t = getattr(p, "tp_degree", tp)
        return ctx.dp_group if t == tp or dg is None else dg.grad[t]

    return group_of


def kv_group_of(ctx, tp: int):
    """For the kv replica sum (oases.dp.replicas): the kv replica group of a block
    of degree t (None where kv heads are not replicated)."""
    dg = ctx.built_degree_groups

    def group_of(t: int):
        return ctx.kv_group if t == tp or dg is None else dg.kv.get(t)

    return group_of
