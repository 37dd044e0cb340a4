"""AMP's search: an exact stage partition for fixed strategies, and the uniform sweep.

AMP (section 3.5) fixes each layer's strategy and cuts the L layers into P
contiguous stages. We minimise the same time per iteration as the MILP in
:mod:`oases.planner.uniap`:

    sum_p T_p + sum_p O_p + (c - 1) max(T_0..T_{P-1}, O_0..O_{P-2})

where T_p is stage p's compute plus its resharding and O_p the transfer at the
cut between p and p+1. The max makes a plain prefix DP inexact, so, as AMP does
with its "tolerance", we fix a bound B on the max: with every T_p, O_p <= B (and
every stage within its memory), a DP over (layer prefix, stages used) minimises
the sum exactly. The answer is min over B of DP(B) + (c - 1) B, B ranging over
every value a stage or a cut can take: for each B the DP's partition costs at
most DP(B) + (c - 1) B, and at B = the optimum's own max the DP finds a sum no
larger than the optimum's. B ascends, DP(B) never grows with B, so once
(c - 1) B + DP(inf) reaches the best found no larger B can win. Other schedules weigh
the pieces (:meth:`oases.planner.uniap.Instance.time_weights`: alpha T_p - kappa W_p in
the sum, beta for the max): the DP sums the weighted stages, the bound still caps T_p.

:func:`search_uniform` is AMP's outer loop: enumerate choices (pp, tp x dp,
micro-batch size...), build an :class:`Instance` for each, try every uniform
strategy of that instance, partition it, keep the fastest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from oases.planner.uniap import Instance, evaluate


@dataclass
class Partition:
    starts: list[int]       # first layer of each stage
    time: float             # time per iteration
    memory: list[float]     # per stage


def _tables(inst: Instance, strat: Sequence[int]):
    """cost[p][i, j] for stage p holding layers i..j-1 (inf where it does not fit in
    stage p's memory or j <= i), gain[p][i, j], what that stage adds to the sum part of
    the time (alpha T_p - kappa W_p of :meth:`Instance.time_weights`; ``cost`` itself
    where those are 1 and 0), and cut[p][i], the transfer at the cut p | p + 1 when
    layer i starts stage p + 1: numpy arrays from prefix sums, O(P L^2) without a
    Python loop over the pairs. Memory is compared with a relative slack of 1e-12:
    prefix differences may round a plan that fills its stage exactly one ulp over."""
    L, P = inst.L, inst.stages
    idx = np.arange(L)
    prev = np.array([0] + list(strat[:-1]))
    cost, gain, cut = [], [], []
    alpha, _, kappa = inst.time_weights()
    upper = np.triu(np.ones((L + 1, L + 1), dtype=bool), 1)  # j > i
    for p in range(P):
        t = np.array([inst.t[p][l][strat[l]] for l in range(L)])
        e = np.array([0.0] + [inst.e[p][l][prev[l]][strat[l]] for l in range(1, L)])
        w = np.array([inst.wgrad[p][l][strat[l]] for l in range(L)])
        A, E, W = (np.concatenate([[0.0], np.cumsum(v)]) for v in (t, e, w))
        # stage [i, j): t of i..j-1, e of i+1..j-1 (E[i + 1] for i < L; unused at i = L)
        E_in = np.concatenate([E[1:], [E[-1]]])
        c = (A[None, :] - A[:, None]) + (E[None, :] - E_in[:, None])
        ok = upper.copy()
        for st in inst.states[p]:  # every memory state of the stage within its limit
            M = np.concatenate([[0.0], np.cumsum(
                [inst.layer_memory(p, l, strat[l], st) for l in range(L)])])
            ok &= (M[None, :] - M[:, None]) <= inst.memory_limit[p] * (1 + 1e-12)
        cost.append(np.where(ok, c, np.inf))
        if (alpha, kappa) == (1.0, 0.0):
            gain.append(cost[-1])
        else:
            gain.append(np.where(ok, alpha * c - kappa * (W[None, :] - W[:, None]), np.inf))
    for p in range(P - 1):
        x = np.zeros(L + 1)
        x[1:L] = [inst.x[p][i][strat[i - 1]][strat[i]] for i in idx[1:]]
        cut.append(x)
    return cost, gain, cut


def _dp(inst: Instance, cost, gain, cut, bound: float):
    """Least sum of stage gains and cut costs with every piece's cost <= bound; (sum,
    starts) or None. One vectorised step per stage: best[j] = min_i prev[i] + cut into i
    + gain[i, j]."""
    L, P = inst.L, inst.stages
    best = np.full(L + 1, np.inf)
    best[0] = 0.0
    args = []
    for p in range(P):
        into = cut[p - 1] if p else np.zeros(L + 1)
        start = np.where(into <= bound, best + into, np.inf)
        piece = np.where(cost[p] <= bound, gain[p], np.inf)
        total = start[:, None] + piece       # (i, j)
        arg = np.argmin(total, axis=0)       # the first i on ties
        best = total[arg, np.arange(L + 1)]
        args.append(arg)
    if not np.isfinite(best[L]):
        return None
    starts, j = [], L
    for p in range(P - 1, -1, -1):
        j = int(args[p][j])
        starts.append(j)
    return float(best[L]), starts[::-1]


def partition(inst: Instance, strat: Sequence[int]) -> Optional[Partition]:
    """The best contiguous P-stage partition for per-layer strategy indices ``strat``
    (None if no partition fits in memory).

    The bound sweep of the module docstring, without evaluating every candidate
    bound: DP(b) only shrinks as b grows, so for candidates v_i <= b <= v_j
    DP(b) + (c - 1) b >= DP(v_j) + (c - 1) v_i; a range where that is no better than
    the best found is dropped whole, others are halved. The smallest feasible bound
    is found by bisection (feasibility only grows with b)."""
    cost, gain, cut = _tables(inst, strat)
    c = inst.time_weights()[1]  # the weight of the max: c - 1 under the 1F1B family
    free = _dp(inst, cost, gain, cut, math.inf)
    if free is None:
        return None
    if c == 0:
        return _result(inst, free[1], strat)
    finite = np.concatenate([m[np.isfinite(m)] for m in cost] + [x[1:inst.L] for x in cut])
    values = np.unique(finite)
    memo: dict = {}

    def dp_at(k):
        if k not in memo:
            memo[k] = _dp(inst, cost, gain, cut, float(values[k]))
        return memo[k]

    lo, hi = 0, len(values) - 1  # dp_at(hi) is ``free``: every piece is <= the largest value
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if dp_at(mid) is None else (lo, mid)
    best_t, best_starts = dp_at(lo)[0] + c * values[lo], dp_at(lo)[1]
    todo = [(lo + 1, len(values) - 1)]
    while todo:
        i, j = todo.pop()
        if i > j or c * values[i] + free[0] >= best_t:
            continue
        got = dp_at(j)
        if got[0] + c * values[i] >= best_t:
            continue
        if got[0] + c * values[j] < best_t:
            best_t, best_starts = got[0] + c * values[j], got[1]
        mid = (i + j - 1) // 2
        todo += [(mid + 1, j - 1), (i, mid)]  # the lower half first
    return _result(inst, best_starts, strat)


def _result(inst, starts, strat) -> Partition:
    t, mems = evaluate(inst, starts, strat)
    return Partition(list(starts), t, mems)


@dataclass
class Choice:
    key: object             # what the caller enumerated, e.g. (pp, tp, dp, micro-batch)
    strategy: str           # the uniform strategy every layer takes
    partition: Partition


def best_uniform(inst: Instance) -> Optional[Choice]:
    """The fastest single strategy for every layer, each optimally partitioned."""
    best = None
    for s, name in enumerate(inst.strategies):
        part = partition(inst, [s] * inst.L)
        if part is not None and (best is None or part.time < best.partition.time):
            best = Choice(None, name, part)
    return best


def search_uniform(choices: Iterable,
                   build: Callable[[object], Optional[Instance]]) -> list[Choice]:
    """AMP's sweep: ``build(choice)`` gives the Instance for one (pp, tp, dp,
    micro-batch...) choice (None to skip it); every uniform strategy of it is
    partitioned. Returns the feasible choices, fastest first."""
    found = []
    for key in choices:
        inst = build(key)
        got = best_uniform(inst) if inst is not None else None
        if got is not None:
            got.key = key
            found.append(got)
    return sorted(found, key=lambda ch: ch.partition.time)
