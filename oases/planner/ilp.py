"""The planner's integer linear program (PuLP; CBC bundled, HiGHS when highspy is there).

Variables: x[i][k] = 1 if block i takes degree k (one-hot per block); for each
adjacent pair a joint y[i][k][l] in [0, 1] with sum_l y = x[i-1][k] and
sum_k y = x[i][l] (the product of two one-hots: with integral x these margins
force y to that product, so y needs no integrality); z >= the transient memory
of every block's choice (the runtime peak is a max, linearised); e >= the
replica gradient syncs that outlast the backward (also a max, linearised).

    minimise   sum node[i,k] x[i,k] + sum edge[i,k,l] y[i,k,l] + e
    subject to sum mem[i,k] x[i,k] + z + static + mixed u <= memory limit
               e >= sum_{j<=i} sync[j,k] x[j,k] - sum_{j<i} free[j,k] x[j,k]   for every i
               u >= x[i,k] for every block i and degree k below tp         (u binary)

``mixed``: the memory of the communicators a plan with any block below tp adds (its
per-block degree groups, :func:`oases.planner.comm_memory.pp1_bytes`); u says whether
the plan has one.
"""

from __future__ import annotations

import itertools
import time
import warnings
from dataclasses import dataclass
from typing import Optional

import pulp

from oases.errors import UserError
from oases.planner.cost import CostModel


@dataclass
class Solution:
    degrees: list[int]
    time_s: float
    memory_bytes: float
    solver: str
    solve_s: float


def _solver(msg: bool = False):
    try:
        import highspy  # noqa: F401  # deferred: optional solver, probed at solve time

        return pulp.HiGHS(msg=msg)
    except Exception:
        return pulp.PULP_CBC_CMD(msg=msg)


def min_memory(cm: CostModel, mixed: float = 0.0) -> float:
    """The least memory any plan needs (every block at its cheapest degree, or all at tp
    when that needs less with ``mixed`` added to the others)."""
    best = [min(cm.degrees, key=lambda t: cm.mem[k, t] + cm.trans[k, t]) for k in cm.kinds]
    need = _with_mixed(cm, best, mixed)
    return min(need, _with_mixed(cm, [cm.tp] * cm.n, mixed)) if cm.tp in cm.degrees else need


def _with_mixed(cm: CostModel, plan: list[int], mixed: float) -> float:
    """A plan's memory, with ``mixed`` when a block runs below tp."""
    return cm.plan_memory(plan) + (mixed if any(t != cm.tp for t in plan) else 0.0)


def solve(cm: CostModel, memory_limit_bytes: Optional[float] = None, msg: bool = False,
          mixed: float = 0.0) -> Solution:
    with warnings.catch_warnings():  # PuLP 3.x announces its 4.0 API on every variable
        warnings.simplefilter("ignore", DeprecationWarning)
        return _solve(cm, memory_limit_bytes, msg, mixed)


def _solve(cm: CostModel, memory_limit_bytes: Optional[float], msg: bool,
           mixed: float = 0.0) -> Solution:
    t0 = time.perf_counter()
    n, D = cm.n, cm.degrees
    prob = pulp.LpProblem("oases_plan", pulp.LpMinimize)
    x = [[pulp.LpVariable(f"x_{i}_{t}", cat="Binary") for t in D] for i in range(n)]
    y = [None] + [[[pulp.LpVariable(f"y_{i}_{a}_{b}", lowBound=0, upBound=1) for b in D]
                   for a in D] for i in range(1, n)]
    z = pulp.LpVariable("z_transient", lowBound=0)
    e = pulp.LpVariable("e_sync_exposed", lowBound=0)
    obj = [cm.node_cost(i, t) * x[i][k] for i in range(n) for k, t in enumerate(D)]
    obj += [cm.edge_cost(i, a, b) * y[i][ka][kb] for i in range(1, n)
            for ka, a in enumerate(D) for kb, b in enumerate(D)]
    prob += pulp.lpSum(obj) + cm.constant_time() + e
    for i in range(n):  # e >= what the syncs launched from block i on need beyond the backward
        prob += e >= pulp.lpSum(cm.sync[cm.kinds[j], t] * x[j][k] for j in range(i + 1)
                                for k, t in enumerate(D)) - \
            pulp.lpSum(cm.free[cm.kinds[j], t] * x[j][k] for j in range(i) for k, t in enumerate(D))
    for i in range(n):
        prob += pulp.lpSum(x[i]) == 1
        prob += z >= pulp.lpSum(cm.trans[cm.kinds[i], t] * x[i][k] for k, t in enumerate(D))
    for i in range(1, n):
        for ka in range(len(D)):
            prob += pulp.lpSum(y[i][ka]) == x[i - 1][ka]
        for kb in range(len(D)):
            prob += pulp.lpSum(y[i][ka][kb] for ka in range(len(D))) == x[i][kb]
    if memory_limit_bytes is not None:
        row = pulp.lpSum(cm.mem[cm.kinds[i], t] * x[i][k] for i in range(n)
                         for k, t in enumerate(D)) + z + cm.static_memory()
        if mixed:
            u = pulp.LpVariable("u_mixed", cat="Binary")
            for i in range(n):
                for k, t in enumerate(D):
                    if t != cm.tp:
                        prob += u >= x[i][k]
            row += mixed * u
        prob += row <= memory_limit_bytes
    solver = _solver(msg)
    status = prob.solve(solver)
    if pulp.LpStatus[status] != "Optimal":
        need = min_memory(cm, mixed)
        if memory_limit_bytes is not None and need > memory_limit_bytes:
            raise UserError(f"no plan fits in {memory_limit_bytes / 2**30:.2f} GiB per device: "
                            f"the smallest plan needs {need / 2**30:.2f} GiB")
        raise RuntimeError(f"ILP solver ended with status {pulp.LpStatus[status]}")
    degrees = [D[max(range(len(D)), key=lambda k: x[i][k].value() or 0)] for i in range(n)]
    return Solution(degrees, cm.plan_time(degrees), cm.plan_memory(degrees),
                    solver.name, time.perf_counter() - t0)


def brute_force(cm: CostModel, memory_limit_bytes: Optional[float] = None,
                mixed: float = 0.0) -> Optional[Solution]:
    """Every plan, for checking the ILP on small instances."""
    best = None
    for plan in itertools.product(cm.degrees, repeat=cm.n):
        plan = list(plan)
        if memory_limit_bytes is not None and \
                _with_mixed(cm, plan, mixed) > memory_limit_bytes:
            continue
        t = cm.plan_time(plan)
        if best is None or t < best.time_s - 1e-12:
            best = Solution(plan, t, cm.plan_memory(plan), "brute-force", 0.0)
    return best


def best_uniform(cm: CostModel, memory_limit_bytes: Optional[float] = None,
                 mixed: float = 0.0) -> Optional[Solution]:
    best = None
    for t in cm.degrees:
        plan = [t] * cm.n
        if memory_limit_bytes is not None and \
                _with_mixed(cm, plan, mixed) > memory_limit_bytes:
            continue
        s = Solution(plan, cm.plan_time(plan), cm.plan_memory(plan), "uniform", 0.0)
        if best is None or s.time_s < best.time_s:
            best = s
    return best
