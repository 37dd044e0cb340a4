"""One MILP over pipeline stages and per-layer strategies (UniAP's formulation).

An :class:`Instance` is abstract: L layers in order, P stages, opaque strategy
labels (``"tp2"``, ``"dp"``, ``"fsdp"``...) and, per layer and strategy, the
numbers the solver trades off. Nothing here knows how a strategy runs.

Data (p stage, l layer, s/r strategy; ``t``/``m``/``a``/``e`` may be given per
stage and ``x`` per cut, or once for all):
  t[p][l][s]  forward+backward of one micro-batch on stage p's devices
  m[p][l][s]  parameter, gradient and optimizer bytes per device
  a[p][l][s]  activation bytes one micro-batch in flight keeps per device
  e[p][l][r][s]  resharding when l-1 (strategy r) and l (strategy s) share stage p
  x[p][l][r][s]  transfer when l-1 ends stage p (strategy r) and l starts p+1 (s)
                 (p < P - 1: stage p's cut; a heterogeneous cluster's links differ)
  w[p][l][s]  (zero-bubble kinds) the W part of t: the linear layers' weight gradients
  b[p][l][s]  (zero-bubble kinds) bytes a pending W keeps: its linears' X and dY
  M[p], c micro-batches; the schedule's memory states (f, q) of stage p, f micro-batches
  between F and B, q between B and W (:mod:`oases.planner.pipe_cost`).

Variables: z[l][p] (layer l on stage p), y[l][s] (layer l takes s), binary;
w[l][p][s] = z[l][p] y[l][s]; for l >= 1, v[l][p][r][s] = w[l-1][p][r] w[l][p][s]
(same stage p and the pair r -> s) and g[l][p][r][s] = w[l-1][p][r] w[l][p+1][s]
(boundary p | p+1 and the pair r -> s); C >= every stage and transfer cost.
Every product q = a b of 0/1 quantities is linear in the model through margins
(below): w's rows sum to z and y, the pairs' rows to w, and with integral z, y those
transport rows leave each product only its value a b (a one-hot row and a one-hot
column meet in one cell). The McCormick rows

    q <= a,   q <= b,   q >= a + b - 1,   q >= 0

are then implied, and are written only for the ablation without the pair margins
(they tripled the rows and slowed CBC's root LP). Then

    T_p = sum_{l,s} t[p][l][s] w[l][p][s] + sum_{l,r,s} e[p][l][r][s] v[l][p][r][s]
    O_p = sum_{l,r,s} x[p][l][r][s] g[l][p][r][s]                  (p < P - 1)
    minimise   sum_p T_p + sum_p O_p + (c - 1) C                  (UniAP's TPI)
    subject to C >= T_p,  C >= O_p
               sum_p z[l][p] = 1,  sum_s y[l][s] = 1
               sum_{l,s} (m[p][l][s] + f a[p][l][s] + q b[p][l][s]) w[l][p][s] <= M[p]
                                                     (every memory state (f, q) of p)
(the 1F1B family; other schedules weigh the objective's parts and subtract W's:
alpha sum_p T_p + sum_p O_p + beta C - kappa sum_p W_p, ``pipe_cost.time_weights``).

Order preservation. UniAP (appendix B, for a DAG) makes each stage's layers a
contiguous set with an auxiliary Z[l][p] in [0, 1]:
  (6a) Z[v][p] >= z[v][p];  (6b) Z[v][p] <= Z[u][p];  (6c) Z[v][p] <= z[v][p] - z[u][p] + 1
for every edge u -> v. Those alone do not order the stages (stage 1's interval
could come before stage 0's, and the transfer cost would then be charged at the
wrong boundary), so a stage order is needed on top; on a chain of layers the
order already implies contiguity, and we use it alone:

    z[0][0] = 1,   z[L-1][P-1] = 1,   z[l][p] <= z[l-1][p] + z[l-1][p-1]  (l >= 1)

Proof: the third constraint says layer l's stage is layer l-1's or the next one,
so the stage index starts at 0, never decreases and grows by at most one per
layer; ending at P-1 it takes every value 0..P-1, each on one run of layers:
stages are non-empty, contiguous and in pipeline order. Conversely every such
placement satisfies the three. For the LP bound we add valid equalities (they
hold for every such placement, and on their own they too force the step rule):
w[l][p][s] = sum_r (v[l][p][r][s] + g[l][p-1][r][s]), and likewise for l-1
(they make v and g the products); sum_s w[l][p][s] = z[l][p] and
sum_p w[l][p][s] = y[l][s] hold for any placement and stay always (they make w
the product). ``order_preserving=False`` drops the order rows and the pair
equalities (keeping "every stage non-empty"; v and g then get McCormick rows), an
ablation for tests only: a layer then may return to an earlier stage, the step
back costs nothing, and the objective can only drop. Memory rows are written in
units of the largest limit (:func:`_memory_unit`).

Scale (CBC, 2 shared cores, random costs, memory limit 1.1x the leanest uniform
plan's peak, gap 1e-3): 6 layers x 2 stages x 3 strategies solve to optimality in
0.07 s, 12 x 3 x 3 in 0.9 s (0.5 s from AMP's best uniform plan as ``start``),
24 x 4 x 3 in 4.4 s (3.0 s); 40 x 6 x 4 stops at the 10 s limit 7% from its bound.
About 2 L P S^2 pair variables: the layout search (:mod:`oases.planner.search`)
runs one MILP per layout within a shared budget, each started from AMP's plan.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence

import pulp

from oases.errors import ConfigError, UserError
from oases.pipeline.schedules import KINDS
from oases.planner.pipe_cost import pipeline_states, time_weights

SCHEDULES = KINDS


def _depth(x) -> int:
    d = 0
    while isinstance(x, (list, tuple)):
        d, x = d + 1, (x[0] if len(x) else 0.0)
    return d


@dataclass
class Instance:
    """One pipeline-planning problem; ``t``, ``m``, ``a`` are [l][s] or [p][l][s]."""

    strategies: list[str]
    stages: int
    micro_batches: int
    t: list
    m: list
    a: list
    memory_limit: object  # one number for every stage, or one per stage
    e: Optional[list] = None  # [l][r][s] or [p][l][r][s]; row l = 0 unused
    x: Optional[list] = None  # [l][r][s] or [cut p < P - 1][l][r][s]; row l = 0 unused
    schedule: str = "1f1b"
    wgrad: Optional[list] = None  # w[.][l][s] of the module docstring (zero-bubble kinds)
    stash: Optional[list] = None  # b[.][l][s]: a pending W's bytes (zero-bubble kinds)
    virtual: int = 1              # chunks per rank (interleaved-1f1b)
    L: int = field(init=False)
    S: int = field(init=False)

    def __post_init__(self):
        P, S = self.stages, len(self.strategies)
        L = len(self.t[0]) if _depth(self.t) == 3 else len(self.t)
        self.L, self.S = L, S
        if P < 1 or L < P:
            raise ConfigError(f"need 1 <= stages <= layers, got {P} stages for {L} layers")
        if self.micro_batches < 1 or self.schedule not in SCHEDULES:
            raise ConfigError(f"bad micro-batches {self.micro_batches} or schedule "
                              f"{self.schedule!r} (one of {SCHEDULES})")
        zero = [[0.0] * S for _ in range(L)]
        self.wgrad, self.stash = self.wgrad or zero, self.stash or zero
        for name in ("t", "m", "a", "wgrad", "stash"):
            setattr(self, name, self._per_stage(name, getattr(self, name)))
        self.states  # a schedule the generators refuse fails here, by name
        zero = [[[0.0] * S for _ in range(S)] for _ in range(L)]
        for name, n in (("e", P), ("x", P - 1)):
            setattr(self, name, self._pairs(name, getattr(self, name) or zero, n))
        lim = self.memory_limit
        lim = list(lim) if isinstance(lim, (list, tuple)) else [lim] * P
        if len(lim) != P:
            raise ConfigError(f"memory_limit has {len(lim)} entries for {P} stages")
        self.memory_limit = [float(v) for v in lim]

    def _per_stage(self, name, val):
        P, L, S = self.stages, self.L, self.S
        if _depth(val) == 2:
            val = [val] * P
        if len(val) != P or any(len(r) != L or any(len(q) != S for q in r) for r in val):
            raise ConfigError(f"{name} must be [layers={L}][strategies={S}] or "
                              f"[stages={P}][{L}][{S}]")
        return [[[float(v) for v in q] for q in r] for r in val]

    def _pairs(self, name, val, n):
        """``val`` as n tables [l][r][s] (one per stage or cut); one table given for all
        is shared, not copied."""
        L, S = self.L, self.S
        ok = lambda tab: len(tab) == L and all(  # noqa: E731
            len(r) == S and all(len(q) == S for q in r) for r in tab)
        if _depth(val) == 3:
            if not ok(val):
                raise ConfigError(f"{name} must be [layers={L}][{S}][{S}]")
            one = [[[float(v) for v in q] for q in r] for r in val]
            return [one] * n
        if len(val) != n or not all(ok(tab) for tab in val):
            raise ConfigError(f"{name} must be [layers={L}][{S}][{S}] or [{n}][{L}][{S}][{S}]")
        return [[[[float(v) for v in q] for q in r] for r in tab] for tab in val]

    @property
    def states(self) -> list[list[tuple]]:
        """Per stage, its (f, q) memory states (of the schedule and count as they are now)."""
        return pipeline_states(self.schedule, self.stages, self.micro_batches, self.virtual)

    def in_flight(self, p: int) -> float:
        """Micro-batches whose activations stage p holds at its peak (in stages' worth:
        chunks / v under interleaving)."""
        return max(f for f, _ in self.states[p])

    def time_weights(self) -> tuple[float, float, float]:
        """(alpha, beta, kappa) of the objective (module docstring)."""
        return time_weights(self.schedule, self.stages, self.micro_batches, self.virtual)

    def layer_memory(self, p: int, l: int, s: int, state: tuple[float, float]) -> float:
        """Layer l's bytes on stage p at strategy s in memory state (f, q)."""
        f, q = state
        return self.m[p][l][s] + f * self.a[p][l][s] + q * self.stash[p][l][s]


# ---- evaluating one plan (shared by the DP, brute force and the MILP's report) ----

def stage_cost(inst: Instance, p: int, lo: int, hi: int, strat: Sequence[int]) -> float:
    """Compute of layers lo..hi-1 on stage p plus their resharding."""
    return (sum(inst.t[p][l][strat[l]] for l in range(lo, hi))
            + sum(inst.e[p][l][strat[l - 1]][strat[l]] for l in range(lo + 1, hi)))


def stage_memory(inst: Instance, p: int, lo: int, hi: int, strat: Sequence[int]) -> float:
    """Stage p's peak over its memory states."""
    return max(sum(inst.layer_memory(p, l, strat[l], st) for l in range(lo, hi))
               for st in inst.states[p])


def pipeline_time(stage_costs: Sequence[float], transfer_costs: Sequence[float], c: int) -> float:
    """UniAP's time per iteration: everything once, the slowest piece c - 1 more times."""
    return (sum(stage_costs) + sum(transfer_costs)
            + (c - 1) * max(list(stage_costs) + list(transfer_costs)))


def evaluate(inst: Instance, starts: Sequence[int], strat: Sequence[int]):
    """(time, per-stage memory) of stages starting at ``starts`` (first is 0)."""
    ends = list(starts[1:]) + [inst.L]
    costs = [stage_cost(inst, p, lo, hi, strat) for p, (lo, hi) in enumerate(zip(starts, ends))]
    trans = [inst.x[p][lo][strat[lo - 1]][strat[lo]] for p, lo in enumerate(starts[1:])]
    mems = [stage_memory(inst, p, lo, hi, strat) for p, (lo, hi) in enumerate(zip(starts, ends))]
    alpha, beta, kappa = inst.time_weights()
    if (alpha, kappa) == (1.0, 0.0):  # the 1F1B family: UniAP's TPI as it stands
        return pipeline_time(costs, trans, inst.micro_batches), mems
    place = [sum(lo <= l for lo in starts[1:]) for l in range(inst.L)]
    wgrad = sum(inst.wgrad[place[l]][l][strat[l]] for l in range(inst.L))
    return (alpha * sum(costs) + sum(trans) + beta * max(costs + trans) - kappa * wgrad), mems


@dataclass
class Result:
    stages: list[tuple[int, int]]  # [first, last + 1) per stage
    strategies: list[str]          # per layer
    time: float                    # predicted time per iteration
    memory: list[float]            # per stage, bytes per device
    status: str                    # "optimal" or "feasible (time limit)"
    objective: float               # the solver's objective (equals ``time``)
    bound: Optional[float]         # best lower bound, None if the solver gave none
    gap: Optional[float]           # (objective - bound) / objective, None without a bound
    solver: str
    solve_s: float
    placement: list[int] = field(default_factory=list)  # stage of each layer

    def summary(self) -> str:
        if self.gap is not None:
            gap = f"gap {100 * self.gap:.2f}% to bound {self.bound:.6g}"
        elif self.status == "optimal":
            gap = "optimal within the gap tolerance (the solver reported no bound)"
        else:
            gap = "gap unknown (the solver reported no bound)"
        return (f"{self.status}: {self.time:.6g} per iteration, {gap}; "
                f"{self.solver}, {self.solve_s:.2f} s")


class InfeasibleMemory(UserError):
    """No plan fits; ``min_memory`` is the smallest per-device limit that would."""

    def __init__(self, msg: str, min_memory: float):
        super().__init__(msg)
        self.min_memory = min_memory


class NoPlan(RuntimeError):
    """The solver returned no plan: none fits, or none was found in the time limit."""


def solver_for(time_limit: float, gap: float, log_path: str, warm: bool = False):
    opts = dict(msg=False, timeLimit=time_limit, gapRel=gap, warmStart=warm)
    for name in ("HiGHS", "HiGHS_CMD"):
        cls = getattr(pulp, name, None)
        if cls is not None and cls(msg=False).available():
            return cls(**opts)
    return pulp.PULP_CBC_CMD(logPath=log_path, **opts)


def warm_start(inst: Instance, var, C, starts, strat):
    """Set every variable to its value under one contiguous plan."""
    place = [sum(lo <= l for lo in starts[1:]) for l in range(inst.L)]
    pair = lambda l, r, s: l > 0 and (strat[l - 1], strat[l]) == (r, s)  # noqa: E731
    for l in range(inst.L):
        for s in range(inst.S):
            var["y"][l][s].setInitialValue(int(strat[l] == s))
        for p in range(inst.stages):
            var["z"][l][p].setInitialValue(int(place[l] == p))
            for s in range(inst.S):
                var["w"][l][p][s].setInitialValue(int(place[l] == p and strat[l] == s))
                for r in range(inst.S):
                    same = pair(l, r, s) and place[l - 1] == p == place[l]
                    cut = pair(l, r, s) and place[l - 1] == p == place[l] - 1
                    for name, hit in (("v", same), ("g", cut)):
                        if var[name][l][p][r][s] is not None:
                            var[name][l][p][r][s].setInitialValue(int(hit))
    ends = list(starts[1:]) + [inst.L]
    C.setInitialValue(max([stage_cost(inst, p, lo, hi, strat) for p, (lo, hi) in
                           enumerate(zip(starts, ends))]
                          + [inst.x[p][lo][strat[lo - 1]][strat[lo]]
                             for p, lo in enumerate(starts[1:])]))


def _bound(solver, prob, log_path: str):
    """(status word, best bound or None) from the solver after a solve."""
    if isinstance(solver, pulp.PULP_CBC_CMD):
        text = open(log_path).read() if os.path.exists(log_path) else ""
        stopped = "Stopped on time" in text
        lb = re.search(r"^Lower bound:\s*(\S+)", text, re.M)
        if lb:
            return ("feasible (time limit)" if stopped else "optimal"), float(lb.group(1))
        if "Optimal solution found" in text:
            return "optimal", None  # proven within gapRel; CBC prints no bound then
        return ("feasible (time limit)" if stopped else "optimal"), None
    status = "optimal" if prob.sol_status == pulp.LpSolutionOptimal else "feasible (time limit)"
    model = getattr(solver, "solverModel", None) or getattr(prob, "solverModel", None)
    try:  # HiGHS through highspy keeps its model; HiGHS_CMD leaves no bound to read
        return status, float(model.getInfo().mip_dual_bound)
    except Exception:
        return status, None


def _pair_margins(prob, w, v, g, l, P, S):
    """With layer l on stage(l-1) or the next, each w of l-1 (of l) splits exactly
    into the v and g of the pair: valid equalities that make the LP bound tight."""
    for p in range(P):
        for r in range(S):
            prob += (pulp.lpSum(v[l][p][r]) + (pulp.lpSum(g[l][p][r]) if p < P - 1 else 0)
                     == w[l - 1][p][r])
        for s in range(S):
            prob += (pulp.lpSum(v[l][p][r][s] for r in range(S))
                     + (pulp.lpSum(g[l][p - 1][r][s] for r in range(S)) if p else 0)
                     == w[l][p][s])


def _lp(inst: Instance, order_preserving: bool):
    """The MILP's variables and constraints, without objective or memory rows."""
    L, P, S = inst.L, inst.stages, inst.S
    prob = pulp.LpProblem("uniap", pulp.LpMinimize)
    B = dict(cat="Binary")
    z = [[pulp.LpVariable(f"z_{l}_{p}", **B) for p in range(P)] for l in range(L)]
    y = [[pulp.LpVariable(f"y_{l}_{s}", **B) for s in range(S)] for l in range(L)]
    w = [[[pulp.LpVariable(f"w_{l}_{p}_{s}", 0, 1) for s in range(S)] for p in range(P)]
         for l in range(L)]

    def product(q, a, b):
        prob.addConstraint(q <= a)
        prob.addConstraint(q <= b)
        prob.addConstraint(q >= a + b - 1)

    for l in range(L):
        prob += pulp.lpSum(z[l]) == 1
        prob += pulp.lpSum(y[l]) == 1
        for p in range(P):
            prob += pulp.lpSum(w[l][p]) == z[l][p]  # margins: valid, and they tighten the LP
        for s in range(S):
            prob += pulp.lpSum(w[l][p][s] for p in range(P)) == y[l][s]
    for p in range(P):  # every stage holds a layer (implied by the order rows, needed without)
        prob += pulp.lpSum(z[l][p] for l in range(L)) >= 1
    if order_preserving:
        prob += z[0][0] == 1
        prob += z[L - 1][P - 1] == 1
        for l in range(1, L):
            for p in range(P):
                prob += z[l][p] <= z[l - 1][p] + (z[l - 1][p - 1] if p else 0)
    T = [[] for _ in range(P)]
    O = [[] for _ in range(P - 1)]
    v = [[[[None] * S for _ in range(S)] for _ in range(P)] for _ in range(L)]
    g = [[[[None] * S for _ in range(S)] for _ in range(P)] for _ in range(L)]
    for l in range(L):
        for p in range(P):
            T[p] += [inst.t[p][l][s] * w[l][p][s] for s in range(S)]
    for l in range(1, L):
        for p in range(P):
            for r in range(S):
                for s in range(S):
                    v[l][p][r][s] = pulp.LpVariable(f"v_{l}_{p}_{r}_{s}", 0, 1)
                    if not order_preserving:
                        product(v[l][p][r][s], w[l - 1][p][r], w[l][p][s])
                    T[p].append(inst.e[p][l][r][s] * v[l][p][r][s])
                    if p < P - 1:
                        g[l][p][r][s] = pulp.LpVariable(f"g_{l}_{p}_{r}_{s}", 0, 1)
                        if not order_preserving:
                            product(g[l][p][r][s], w[l - 1][p][r], w[l][p + 1][s])
                        O[p].append(inst.x[p][l][r][s] * g[l][p][r][s])
        if order_preserving:  # layer l sits on l-1's stage or the next: the pairs add up
            _pair_margins(prob, w, v, g, l, P, S)
    # per stage, one row per memory state (module docstring)
    mem = [[pulp.lpSum(inst.layer_memory(p, l, s, st) * w[l][p][s]
                       for l in range(L) for s in range(S)) for st in inst.states[p]]
           for p in range(P)]
    W = pulp.lpSum(inst.wgrad[p][l][s] * w[l][p][s] for l in range(L) for p in range(P)
                   for s in range(S) if inst.wgrad[p][l][s])
    var = dict(z=z, y=y, w=w, v=v, g=g, W=W)
    return prob, var, [pulp.lpSum(q) for q in T], [pulp.lpSum(q) for q in O], mem


def _read(inst: Instance, z, y):
    place = [max(range(inst.stages), key=lambda p: z[l][p].value() or 0) for l in range(inst.L)]
    strat = [max(range(inst.S), key=lambda s: y[l][s].value() or 0) for l in range(inst.L)]
    return place, strat


def solve(inst: Instance, time_limit: float = 10.0, gap: float = 1e-3,
          order_preserving: bool = True, start=None, explain: bool = True) -> Result:
    """The best contiguous placement and per-layer strategies; raises
    :class:`InfeasibleMemory` (with the least memory that would fit) if none fits.

    ``start`` = (stage starts, strategy index per layer), a plan that fits (e.g.
    AMP's best uniform one), is handed to the solver as its first incumbent: a
    solve cut short by the time limit then returns nothing worse. ``explain=False``
    skips the second MILP that finds the least memory when nothing fits (a search
    over many instances only needs to know that this one has no plan): the error
    is then a :class:`NoPlan`."""
    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as tmp:
        warnings.simplefilter("ignore", DeprecationWarning)  # PuLP 3.x's 4.0 notices
        return _solve(inst, time_limit, gap, order_preserving, os.path.join(tmp, "cbc.log"),
                      start, explain)


def lp_model(inst: Instance, order_preserving: bool = True):
    """The full MILP: objective, max rows and memory rows on top of :func:`_lp`."""
    prob, var, T, O, mem = _lp(inst, order_preserving)
    C = pulp.LpVariable("C_max", 0)
    for q in T + O:
        prob += C >= q
    alpha, beta, kappa = inst.time_weights()
    if (alpha, kappa) == (1.0, 0.0):
        prob += pulp.lpSum(T) + pulp.lpSum(O) + (inst.micro_batches - 1) * C
    else:
        prob += alpha * pulp.lpSum(T) + pulp.lpSum(O) + beta * C - kappa * var["W"]
    unit = _memory_unit(inst)
    for p in range(inst.stages):
        for row in mem[p]:
            prob += (1 / unit) * row <= inst.memory_limit[p] / unit
    return prob, var, C, mem


def _memory_unit(inst: Instance) -> float:
    """Memory rows are written in units of the largest limit: byte counts (1e10) next
    to times (1e-3) leave CBC's start-up and heuristics crawling on a badly scaled
    matrix (measured: 47 s instead of 0.2 s on a 32-layer instance)."""
    finite = [abs(v) for v in inst.memory_limit if math.isfinite(v) and v]
    return max(finite, default=1.0)


def _solve(inst, time_limit, gap, order_preserving, log_path, start, explain) -> Result:
    t0 = time.perf_counter()
    P = inst.stages
    prob, var, C, mem = lp_model(inst, order_preserving)
    z, y = var["z"], var["y"]
    if start is not None:
        warm_start(inst, var, C, *start)
    solver = solver_for(time_limit, gap, log_path, start is not None)
    try:
        prob.solve(solver)
    except pulp.PulpSolverError as err:  # CBC killed by a very short limit writes no solution
        raise RuntimeError(f"MILP solver stopped without a plan in {time_limit} s: {err}")
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        if not explain:
            raise NoPlan(f"MILP found no plan within {time_limit} s "
                         f"(status {pulp.LpStatus[prob.status]})")
        # memory is the only row a contiguous placement can break; a solver cut
        # short may still call the model infeasible, so check that memory is why
        need = min_memory(inst, order_preserving=order_preserving)
        if prob.status == pulp.LpStatusInfeasible and min(inst.memory_limit) < need < math.inf:
            raise InfeasibleMemory(
                f"no pipeline plan fits in the memory limits {_gib(inst.memory_limit)} per device: "
                f"the leanest plan needs {need / 2**30:.3f} GiB ({need:.0f} bytes) on its "
                f"fullest stage", need)
        raise RuntimeError(f"MILP found no plan within {time_limit} s "
                           f"(status {pulp.LpStatus[prob.status]})")
    status, bound = _bound(solver, prob, log_path)
    place, strat = _read(inst, z, y)
    objective = pulp.value(prob.objective)
    starts = [place.index(p) for p in range(P)] if order_preserving else None
    if starts is not None:
        tpi, mems = evaluate(inst, starts, strat)
        ranges = list(zip(starts, starts[1:] + [inst.L]))
    else:  # the ablation's placement need not be contiguous: report the model's numbers
        tpi, mems = objective, [max(pulp.value(q) for q in rows) for rows in mem]
        ranges = [(place.index(p), len(place) - place[::-1].index(p)) for p in range(P)]
    rel = None if bound is None else max(0.0, objective - bound) / max(abs(objective), 1e-12)
    return Result(ranges, [inst.strategies[s] for s in strat], tpi, mems, status, objective,
                  bound, rel, solver.name, time.perf_counter() - t0, place)


def _gib(limits) -> str:
    vals = sorted(set(limits))
    return "/".join(f"{v / 2**30:.3f}" for v in vals) + " GiB"


def min_memory(inst: Instance, time_limit: float = 10.0, order_preserving: bool = True) -> float:
    """The least memory any plan needs on its fullest stage: the smallest single
    per-device limit under which :func:`solve` finds a plan (a second MILP)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        prob, _, _, _, mem = _lp(inst, order_preserving)
        peak = pulp.LpVariable("peak", 0)
        for rows in mem:
            for q in rows:
                prob += peak >= q
        prob += peak
        prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit))
        if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            return math.inf
        return pulp.value(peak)
