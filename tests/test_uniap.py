"""The pipeline MILP (UniAP) and AMP's partition DP against brute force on small instances."""

import itertools
import math
import random

import pytest

from oases.planner import amp, uniap


def _instance(L, P, S, seed, per_stage=False, schedule="1f1b", c=4, tight=0.5, xscale=1.0):
    """Random costs; the memory limit sits at the ``tight`` quantile of the plans' peaks."""
    rng = random.Random(seed)
    R = lambda: rng.uniform(1.0, 10.0)  # noqa: E731
    grid = lambda: [[R() for _ in range(S)] for _ in range(L)]  # noqa: E731
    pairs = lambda k: [[[k * R() * (r != s) for s in range(S)] for r in range(S)]  # noqa: E731
                       for _ in range(L)]
    t = [grid() for _ in range(P)] if per_stage else grid()
    inst = uniap.Instance([f"s{k}" for k in range(S)], P, c, t, grid(), grid(), math.inf,
                          e=pairs(0.5), x=[[[xscale * R() for _ in range(S)] for _ in range(S)]
                                           for _ in range(L)], schedule=schedule)
    peaks = sorted(max(mem) for _, _, mem in _plans(inst))
    inst.memory_limit = [peaks[int(tight * (len(peaks) - 1))]] * P
    return inst


def _plans(inst, strategies=None):
    """Every contiguous placement x strategy assignment: (starts, strat, memory)."""
    L, P = inst.L, inst.stages
    for cuts in itertools.combinations(range(1, L), P - 1):
        for strat in strategies or itertools.product(range(inst.S), repeat=L):
            starts = [0, *cuts]
            yield starts, strat, uniap.evaluate(inst, starts, strat)[1]


def _brute(inst, strategies=None):
    best = None
    for starts, strat, mem in _plans(inst, strategies):
        if all(m <= lim for m, lim in zip(mem, inst.memory_limit)):
            t = uniap.evaluate(inst, starts, strat)[0]
            best = t if best is None else min(best, t)
    return best


CASES = [  # L, P, S, seed, per-stage t, schedule
    (4, 2, 2, 0, False, "1f1b"),
    (5, 2, 3, 1, False, "eager-1f1b"),
    (6, 2, 3, 2, True, "1f1b"),
    (6, 2, 2, 3, False, "1f1b"),
    (5, 3, 2, 4, True, "eager-1f1b"),
]


@pytest.mark.parametrize("L,P,S,seed,per_stage,schedule", CASES)
def test_milp_equals_brute_force(L, P, S, seed, per_stage, schedule):
    inst = _instance(L, P, S, seed, per_stage, schedule)
    want = _brute(inst)
    got = uniap.solve(inst, gap=1e-9)
    assert got.status == "optimal"
    assert got.time == pytest.approx(want, rel=1e-6)
    assert got.objective == pytest.approx(got.time, rel=1e-6)  # the model prices the plan right
    assert all(m <= lim * (1 + 1e-9) for m, lim in zip(got.memory, inst.memory_limit))
    assert [lo for lo, _ in got.stages] == sorted(lo for lo, _ in got.stages)
    assert got.stages[0][0] == 0 and got.stages[-1][1] == L


def test_order_preserving_constraints_matter():
    """Layers 1, 2, 1 on two stages, two micro-batches: contiguous stages take 1 | 3
    (time 4 + max 3 = 7); without the order rows the solver puts layers 0 and 2
    on one stage (2 | 2, time 6), a plan no pipeline can run."""
    inst = uniap.Instance(["only"], 2, 2, [[1.0], [2.0], [1.0]], [[0.0]] * 3, [[0.0]] * 3, 1.0)
    real = uniap.solve(inst, gap=1e-9)
    loose = uniap.solve(inst, gap=1e-9, order_preserving=False)
    assert real.time == pytest.approx(7.0) and real.placement in ([0, 0, 1], [0, 1, 1])
    assert loose.objective == pytest.approx(6.0) and loose.objective < real.time - 0.5
    assert loose.placement in ([0, 1, 0], [1, 0, 1])


def test_infeasible_memory_reports_minimum():
    inst = _instance(5, 2, 3, 7)
    need = min(max(mem) for _, _, mem in _plans(inst))
    inst.memory_limit = [0.9 * need] * 2
    with pytest.raises(uniap.InfeasibleMemory) as err:
        uniap.solve(inst)
    assert err.value.min_memory == pytest.approx(need, rel=1e-6)
    assert "leanest plan needs" in str(err.value)
    inst.memory_limit = [need * (1 + 1e-9)] * 2  # and at that limit a plan exists
    assert uniap.solve(inst).time == pytest.approx(_brute(inst), rel=1e-3)


@pytest.mark.parametrize("L,P,c,seed", [(6, 2, 4, 0), (7, 3, 3, 1), (6, 3, 1, 2), (6, 4, 8, 3)])
def test_amp_partition_equals_brute_force(L, P, c, seed):
    """Transfers up to 4x a layer's compute, so cuts matter and can be the max."""
    inst = _instance(L, P, 3, seed, per_stage=True, c=c, tight=0.7, xscale=4.0)
    rng = random.Random(seed)
    for _ in range(6):
        strat = [rng.randrange(3) for _ in range(L)]
        want = _brute(inst, [strat])
        got = amp.partition(inst, strat)
        if want is None:
            assert got is None
        else:
            assert got.time == pytest.approx(want, rel=1e-9)
            assert got.time == pytest.approx(uniap.evaluate(inst, got.starts, strat)[0])


@pytest.mark.parametrize("seed,S,sizes,scales", [
    (7, 3, [5, 6], [1.0, 4.0, 8.0]), (116, 3, [5, 6], [1.0, 4.0, 8.0]),
    (129, 3, [5, 6], [1.0, 4.0, 8.0]), (0, 2, [4, 5], [4.0, 8.0, 16.0]),
    (1, 2, [4, 5], [4.0, 8.0, 16.0])])
def test_amp_partition_random(seed, S, sizes, scales):
    """Random sizes, micro-batches and transfer scales: seeds where a bound sweep
    that stops early, or leaves the cuts' costs out of its candidates, loses the
    optimum (the last two have transfers that dwarf every stage)."""
    rng = random.Random(seed)
    L, P, c, xscale = rng.choice(sizes), rng.choice([2, 3]), rng.choice([2, 4, 8]), \
        rng.choice(scales)
    inst = _instance(L, P, S, seed, per_stage=True, c=c, tight=0.8, xscale=xscale)
    strat = [rng.randrange(S) for _ in range(L)]
    assert amp.partition(inst, strat).time == pytest.approx(_brute(inst, [strat]), rel=1e-9)


def test_in_flight_micro_batches():
    inst = _instance(4, 4, 1, 0, c=3)
    assert [inst.in_flight(p) for p in range(4)] == [3, 3, 2, 1]
    inst.schedule = "eager-1f1b"
    assert [inst.in_flight(p) for p in range(4)] == [3, 3, 3, 1]
    inst.micro_batches = 8
    assert [inst.in_flight(p) for p in range(4)] == [7, 5, 3, 1]


@pytest.mark.parametrize("L,P,S,seed", [(6, 2, 3, 11), (6, 3, 2, 12), (5, 2, 3, 13)])
def test_milp_never_worse_than_amp_uniform(L, P, S, seed):
    inst = _instance(L, P, S, seed, per_stage=True, tight=0.9, xscale=2.0)
    uni = amp.best_uniform(inst)
    want = min(_brute(inst, [[s] * L]) or math.inf for s in range(S))
    assert uni.partition.time == pytest.approx(want)
    assert uniap.solve(inst, gap=1e-9).time <= uni.partition.time * (1 + 1e-9)


def test_search_uniform_ranks_choices():
    """AMP's sweep: one Instance per (pp, micro-batches); the fastest comes first."""
    def build(key):
        pp, c = key
        return _instance(6, pp, 2, pp * 10 + c, c=c, tight=1.0)

    found = amp.search_uniform([(1, 4), (2, 4), (3, 2)], build)
    assert [ch.partition.time for ch in found] == sorted(ch.partition.time for ch in found)
    for ch in found:
        assert ch.partition.time == pytest.approx(amp.best_uniform(build(ch.key)).partition.time)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # PuLP 3.x notices
def test_time_limit_keeps_the_warm_start_and_reports_the_gap(monkeypatch):
    """16 layers x 3 stages x 3 strategies: the MILP starts from AMP's best uniform
    plan (every row holds there, the objective is its time), so a solve stopped
    by the time limit never returns worse, and reports its gap."""
    rng = random.Random(5)
    L, P, S = 16, 3, 3
    grid = lambda: [[rng.uniform(1, 10) for _ in range(S)] for _ in range(L)]  # noqa: E731
    pairs = lambda: [[[rng.uniform(1, 10) for _ in range(S)] for _ in range(S)]  # noqa: E731
                     for _ in range(L)]
    inst = uniap.Instance(["a", "b", "c"], P, 4, grid(), grid(), grid(), 160.0,
                          e=pairs(), x=pairs())
    uni = amp.best_uniform(inst)
    start = (uni.partition.starts, [inst.strategies.index(uni.strategy)] * L)
    prob, var, C, _ = uniap.lp_model(inst)
    uniap.warm_start(inst, var, C, *start)
    assert prob.valid(1e-9)
    assert prob.objective.value() == pytest.approx(uni.partition.time)
    solvers = []
    real = uniap.solver_for
    monkeypatch.setattr(uniap, "solver_for", lambda *a: solvers.append(real(*a)) or solvers[-1])
    warmed, warm = [], uniap.warm_start
    monkeypatch.setattr(uniap, "warm_start", lambda *a: warmed.append(a[3:]) or warm(*a))
    got = uniap.solve(inst, time_limit=0.3, start=start)
    assert solvers[0].optionsDict.get("warmStart") and warmed == [start]
    assert all(v.varValue is not None for v in prob.variables())  # _warm left none unset
    assert got.time <= uni.partition.time * (1 + 1e-9)
    strat = [inst.strategies.index(s) for s in got.strategies]
    assert got.time == pytest.approx(uniap.evaluate(inst, [lo for lo, _ in got.stages], strat)[0])
    if got.status != "optimal":
        assert got.status == "feasible (time limit)" and got.bound <= got.objective
        assert got.gap == pytest.approx((got.objective - got.bound) / got.objective)
        assert "gap" in got.summary()


@pytest.mark.parametrize("L,P,S,seed", [(5, 3, 2, 21), (6, 2, 3, 22)])
def test_per_stage_resharding_and_per_cut_transfers(L, P, S, seed):
    """Resharding given per stage and transfers per cut (a heterogeneous cluster's
    stages and links differ): the MILP and AMP's partition still equal brute force,
    and each cut is priced by its own table."""
    rng = random.Random(seed)
    base = _instance(L, P, S, seed, per_stage=True, c=3, tight=0.8, xscale=3.0)
    table = lambda k: [[[k * rng.uniform(1, 10) for _ in range(S)] for _ in range(S)]  # noqa: E731
                       for _ in range(L)]
    inst = uniap.Instance(base.strategies, P, 3, base.t, base.m, base.a, base.memory_limit,
                          e=[table(0.5) for _ in range(P)], x=[table(3.0) for _ in range(P - 1)])
    strat = [rng.randrange(S) for _ in range(L)]
    starts = list(range(P))
    got_t, _ = uniap.evaluate(inst, starts, strat)
    costs = [uniap.stage_cost(inst, p, lo, hi, strat)
             for p, (lo, hi) in enumerate(zip(starts, starts[1:] + [L]))]
    cuts = [inst.x[p][lo][strat[lo - 1]][strat[lo]] for p, lo in enumerate(starts[1:])]
    assert got_t == pytest.approx(uniap.pipeline_time(costs, cuts, 3))
    assert uniap.solve(inst, gap=1e-9).time == pytest.approx(_brute(inst), rel=1e-6)
    assert amp.partition(inst, strat).time == pytest.approx(_brute(inst, [strat]), rel=1e-9)
