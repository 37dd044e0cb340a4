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
(c - 1) B + DP(inf) reaches the best found no larger B can win.

:func:`search_uniform` is AMP's outer loop: enumerate choices (pp, tp x dp,
micro-batch size...), build an :class:`Instance` for each, try every uniform
strategy of that instance, partition it, keep the fastest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

from oases.planner.uniap import Instance, evaluate, stage_cost, stage_memory


@dataclass
class Partition:
    starts: list[int]       # first layer of each stage
    time: float             # time per iteration
    memory: list[float]     # per stage


def _tables(inst: Instance, strat: Sequence[int]):
    """cost[p][i][j], fits[p][i][j] for stage p holding layers i..j-1; cut[i] at layer i."""
    L, P = inst.L, inst.stages
    cost = [[[0.0] * (L + 1) for _ in range(L + 1)] for _ in range(P)]
    fits = [[[False] * (L + 1) for _ in range(L + 1)] for _ in range(P)]
    for p in range(P):
        for i in range(L):
            for j in range(i + 1, L + 1):
                cost[p][i][j] = stage_cost(inst, p, i, j, strat)
                fits[p][i][j] = stage_memory(inst, p, i, j, strat) <= inst.memory_limit[p]
    cut = [0.0] + [inst.x[i][strat[i - 1]][strat[i]] for i in range(1, L)]
    return cost, fits, cut


def _dp(inst: Instance, cost, fits, cut, bound: float):
    """Least sum of stage and cut costs with every piece <= bound; (sum, starts) or None."""
    L, P = inst.L, inst.stages
    INF = math.inf
    # best[p][j]: layers 0..j-1 on stages 0..p-1, stage p-1 ending at j
    best = [[INF] * (L + 1) for _ in range(P + 1)]
    arg = [[-1] * (L + 1) for _ in range(P + 1)]
    best[0][0] = 0.0
    for p in range(P):
        for j in range(p + 1, L - (P - p - 1) + 1):
            for i in range(p, j):
                if best[p][i] == INF or not fits[p][i][j] or cost[p][i][j] > bound:
                    continue
                c = cost[p][i][j] + (cut[i] if p else 0.0)
                if p and cut[i] > bound:
                    continue
                if best[p][i] + c < best[p + 1][j]:
                    best[p + 1][j], arg[p + 1][j] = best[p][i] + c, i
    if best[P][L] == INF:
        return None
    starts, j = [], L
    for p in range(P, 0, -1):
        j = arg[p][j]
        starts.append(j)
    return best[P][L], starts[::-1]


def partition(inst: Instance, strat: Sequence[int]) -> Optional[Partition]:
    """The best contiguous P-stage partition for per-layer strategy indices ``strat``
    (None if no partition fits in memory)."""
    cost, fits, cut = _tables(inst, strat)
    c = inst.micro_batches
    free = _dp(inst, cost, fits, cut, math.inf)
    if free is None:
        return None
    if c == 1:
        return _result(inst, free[1], strat)
    values = sorted({cost[p][i][j] for p in range(inst.stages) for i in range(inst.L)
                     for j in range(i + 1, inst.L + 1) if fits[p][i][j]} | set(cut[1:]))
    best_t, best_starts = math.inf, None
    for b in values:
        if (c - 1) * b + free[0] >= best_t:
            break
        got = _dp(inst, cost, fits, cut, b)
        if got is not None and got[0] + (c - 1) * b < best_t:
            best_t, best_starts = got[0] + (c - 1) * b, got[1]
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
