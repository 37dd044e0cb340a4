"""The planner's price of each pipeline schedule (oases.planner.pipe_cost): the time
against the simulator, the memory rows against the simulated timelines, the W split of
the cost model, the solvers under the new objectives, and the search's choice of
schedule. Cost model only: no torch run."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from oases.pipeline.actions import simulate
from oases.pipeline.schedules import SPLIT_KINDS, VIRTUAL_KINDS, pipeline_actions
from oases.planner import amp, pipe_cost, uniap
from oases.planner import stages as st
from oases.planner.cluster import load_cluster
from oases.planner.cost import CostModel, ModelShape
from oases.planner.fit import analytic_profile
from oases.planner.search import CHOOSABLE, search
from oases.planner.uniap import Instance, evaluate, stage_memory

FLAT = ("gpipe", "1f1b", "eager-1f1b", "zb-h1", "eager-zb-h1")
COSTS = [(1.0, 2.0, 0.8), (1.0, 1.0, 1.0), (1.3, 1.7, 0.5)]  # f, b (input part), w <= f, b
SHAPE = ModelShape("gpt", 4, 256, 8, 8, 1024, 512, 64)


def _uniform(kind, P, c, f, b, w, v=1, a=1.0, stash=0.0):
    """P equal stages of one layer each: T = f + b + w, of which w is W."""
    return Instance(["s"], P, c, [[f + b + w]] * P, [[0.0]] * P, [[a]] * P, math.inf,
                    schedule=kind, wgrad=[[w]] * P, stash=[[stash]] * P, virtual=v)


def _sim(kind, P, c, f, b, w, v=1):
    return simulate(pipeline_actions(kind, P, c, virtual=v), f, b, 0.0, w_cost=w)


CASES = [(k, P, c, 1) for k in FLAT for P in (2, 3, 4) for c in (P, P + 1, 2 * P)] + \
    [("interleaved-1f1b", P, c, v) for P in (2, 4) for c in (P, 2 * P) for v in (2, 3)]


@pytest.mark.parametrize("kind,P,c,v", CASES)
def test_time_is_the_simulated_makespan_of_equal_stages(kind, P, c, v):
    """With equal stages and no transfers the planner's time per iteration (the
    instance's, and the closed form) is the simulator's makespan, W's included."""
    for f, b, w in COSTS:
        want = _sim(kind, P, c, f, b, w, v).makespan
        got = evaluate(_uniform(kind, P, c, f, b, w, v), list(range(P)), [0] * P)[0]
        assert got == pytest.approx(want, rel=1e-12)
        assert pipe_cost.makespan(kind, P, c, f, b, w, v) == pytest.approx(want, rel=1e-12)


def test_zero_bubble_cuts_the_bubble_to_f_plus_b_minus_w():
    """pp = 4, m = 8, f = b = w: 1F1B idles 3 (f + b + w) per stage, ZB-H1 3 (f + b - w),
    a third; interleaving by 2 halves 1F1B's."""
    T = 3.0
    assert pipe_cost.makespan("1f1b", 4, 8, 1, 1, 1) == 8 * T + 3 * T
    assert pipe_cost.makespan("zb-h1", 4, 8, 1, 1, 1) == 8 * T + 3 * 1
    assert pipe_cost.makespan("eager-zb-h1", 4, 8, 1, 1, 1) == 8 * T + 3 * 1
    assert pipe_cost.makespan("interleaved-1f1b", 4, 8, 1, 1, 1, 2) == 8 * T + 3 * T / 2


def _walk_peak(row, a, b, v, split):
    """The most bytes a stage's simulated order holds: a per F not yet B (1/v of it per
    chunk), b per B not yet W."""
    f = q = peak = 0.0
    for act, _, _ in row:
        if act.kind == "F":
            f += a / v
        elif act.kind == "B":
            f -= a / v
            q += b if split else 0.0
        else:
            q -= b
        peak = max(peak, f + q)
    return peak


@pytest.mark.parametrize("kind,P,c,v", CASES)
def test_memory_row_is_the_timelines_peak(kind, P, c, v):
    """The row of every stage (its largest memory state) is the simulated timeline's:
    ``peak_inflight`` activations (chunks of 1/v) with no pending-W bytes,
    ``peak_stashed`` when a pending W keeps as much as an activation, and the walk's
    peak when it keeps more (recompute: b > a) or less."""
    tl = _sim(kind, P, c, 1.0, 1.5, 0.7, v)
    split = kind in SPLIT_KINDS
    mem = lambda inst: [stage_memory(inst, p, p, p + 1, [0] * P) for p in range(P)]  # noqa: E731
    assert mem(_uniform(kind, P, c, 1, 1.5, 0.7, v)) == pytest.approx(
        [k / v for k in tl.peak_inflight])
    if split:
        assert mem(_uniform(kind, P, c, 1, 1.5, 0.7, stash=1.0)) == tl.peak_stashed
        if kind == "zb-h1":  # no stage above 1F1B's stage 0
            assert tl.peak_stashed == [min(c, P)] * P
    for b in (0.3, 2.5):
        got = mem(_uniform(kind, P, c, 1, 1.5, 0.7, v, a=1.0, stash=b))
        assert got == pytest.approx([_walk_peak(r, 1.0, b, v, split) for r in tl.spans])


def test_zero_bubble_memory_states():
    """ZB-H1 at pp = 4, m = 8: stage p holds 4 - p activations and p pending W's, or one
    activation fewer and one W more (right after a B); eager-ZB-H1 the same over
    eager-1F1B's 7, 5, 3, 1."""
    got = pipe_cost.pipeline_states("zb-h1", 4, 8)
    assert got == [[(4 - p - 1.0, p + 1.0), (4.0 - p, float(p))] for p in range(4)]
    eager = pipe_cost.pipeline_states("eager-zb-h1", 4, 8)
    assert [max(s) for s in eager] == [(7.0, 0.0), (5.0, 1.0), (3.0, 2.0), (1.0, 3.0)]
    assert pipe_cost.pipeline_states("interleaved-1f1b", 4, 8, 2) == \
        [[(5.5, 0.0)], [(4.5, 0.0)], [(3.5, 0.0)], [(2.5, 0.0)]]


def _random(kind, L, P, S, seed, v=1, c=4):
    rng = random.Random(seed)
    t = [[[rng.uniform(1, 3) for _ in range(S)] for _ in range(L)] for _ in range(P)]
    w = [[[rng.uniform(0.1, 0.3) * x for x in row] for row in tp] for tp in t]
    m = [[rng.uniform(1, 2) for _ in range(S)] for _ in range(L)]
    a = [[rng.uniform(0.2, 1) for _ in range(S)] for _ in range(L)]
    b = [[rng.uniform(0.1, 1.5) for _ in range(S)] for _ in range(L)]
    x = [[[rng.uniform(0, 1) for _ in range(S)] for _ in range(S)] for _ in range(L)]
    return Instance([f"s{i}" for i in range(S)], P, c, t, m, a, 1e9, x=x, schedule=kind,
                    wgrad=w if kind in SPLIT_KINDS else None, stash=b, virtual=v)


def _brute(inst, strats=None):
    best = math.inf
    for cuts in itertools.combinations(range(1, inst.L), inst.stages - 1):
        for strat in strats or itertools.product(range(inst.S), repeat=inst.L):
            t, mem = evaluate(inst, [0, *cuts], strat)
            if all(u <= lim for u, lim in zip(mem, inst.memory_limit)):
                best = min(best, t)
    return best


@pytest.mark.parametrize("kind,v,seed", [("zb-h1", 1, 1), ("eager-zb-h1", 1, 2),
                                         ("interleaved-1f1b", 2, 3)])
def test_milp_and_amp_equal_brute_force_under_other_schedules(kind, v, seed):
    """The MILP's objective and AMP's partition carry the schedule's weights and memory
    rows: both find the brute-force optimum (a limit that binds on some plans)."""
    inst = _random(kind, 5, 2, 2, seed, v)
    peaks = [max(evaluate(inst, [0, k], s)[1]) for k in range(1, 5)
             for s in itertools.product(range(2), repeat=5)]
    inst.memory_limit = [sorted(peaks)[len(peaks) // 3]] * 2
    best = _brute(inst)
    assert uniap.solve(inst, gap=1e-9).time == pytest.approx(best, rel=1e-6)
    for s in range(2):
        part = amp.partition(inst, [s] * 5)
        want = _brute(inst, [[s] * 5])
        assert (part is None) == (want == math.inf)
        if part is not None:
            assert part.time == pytest.approx(want, rel=1e-9)


def test_wgrad_split_of_the_cost_model():
    """W of an attention block is M / (2 (M + seq d)) of its backward (M its matrix
    parameters: the linears' dW against all backward matmuls, attention's score and value
    matmuls in B), half of an MLP's; never above the forward; the pending W keeps every
    linear's X and dY."""
    job = st.Job(SHAPE, 8, 2, "oases", "none", "zb-h1")
    base = st.profile_run(job, 4, 8)
    prof = analytic_profile(SHAPE, base, SHAPE.valid_degrees(4), 5e9)
    cluster = load_cluster("configs/cluster/hetero-4.yaml")
    cm = CostModel(SHAPE, job.run(4, 1, 8), cluster, prof, [4])
    d, seq = SHAPE.d_model, SHAPE.seq_len
    assert cm.wgrad_share("attn") == pytest.approx(4 * d * d / (2 * (4 * d * d + seq * d)))
    assert cm.wgrad_share("mlp") == 0.5
    for k in ("attn", "mlp"):
        e = cm.profile.blocks[k]["4"]
        assert cm.wgrad_time(k, 4) == pytest.approx(2 * min(cm.wgrad_share(k) * e["bwd"],
                                                            e["fwd"]))
    rows = 8 * seq * 4  # 8 sequences of 64 tokens (2 sub-batches of 4), fp32
    assert cm.wgrad_bytes("attn", 4) == pytest.approx(rows * (2 * d + 4 * d / 4))
    assert cm.wgrad_bytes("mlp", 4) == pytest.approx(rows * (2 * d + 2 * 1024 / 4))


def _search(schedules, **kw):
    cluster = load_cluster("configs/cluster/hetero-4.yaml")
    job = st.Job(SHAPE, 8, 2, "megatron", "none")
    base = st.profile_run(job, 4, 8)
    prof = analytic_profile(SHAPE, base, SHAPE.valid_degrees(4), 5e9)
    return search(job, 4, cluster, prof, base, "amp", log=lambda *_: None,
                  schedules=schedules, **kw)


def test_search_chooses_the_schedule():
    """The search prices every pipelined layout under each schedule it is given; ZB-H1
    beats 1F1B at the same layout, and the best pipelined pick is a zero-bubble one,
    faster than the best 1F1B pipeline."""
    assert set(VIRTUAL_KINDS) <= set(CHOOSABLE)  # every schedule a run executes
    only = _search(None)
    assert {c.schedule for c in only.ranked} == {"1f1b"}
    both = _search(("1f1b", "zb-h1"))
    by = {}
    for c in both.ranked:
        by.setdefault(c.key()[:-1], {})[c.schedule] = c
    pairs = [v for v in by.values() if len(v) == 2]
    assert pairs and all(v["zb-h1"].time < v["1f1b"].time for v in pairs)
    assert all(c.choice.pp > 1 for v in pairs for c in v.values())
    # (here one stage of dp x tp wins overall: a single stage runs no pipeline schedule)
    piped = lambda res: min((c for c in res.ranked if c.choice.pp > 1),  # noqa: E731
                            key=lambda c: c.time)
    assert piped(both).schedule == "zb-h1" and piped(both).time < piped(only).time
    assert "(zb-h1)" in piped(both).describe()


def test_search_prices_interleaving_on_the_even_split_only():
    """interleaved-1f1b runs pp x v equal chunks at the stage's degree
    (PipelineLayout.chunks): its candidates are exactly those (v = 2 unless the config
    says), priced with the interleaved time weights, so at the same layout it beats 1F1B
    (a v-fold smaller bubble; the planner prices no transfer, whose count it multiplies)."""
    res = _search(("1f1b", "interleaved-1f1b"))
    inter = [c for c in res.ranked if c.schedule == "interleaved-1f1b"]
    assert inter and all(c.virtual == 2 and c.source == "megatron" for c in inter)
    for c in inter:
        ch = c.choice
        assert c.starts == [SHAPE.n_layer // ch.pp * i for i in range(ch.pp)]
        assert set(c.degrees) == {ch.tp} and ch.micro_batches % ch.pp == 0
        assert SHAPE.n_layer % (ch.pp * 2) == 0
    by = {(c.choice, tuple(c.starts), tuple(c.strat)): c for c in res.ranked
          if c.schedule == "1f1b"}
    same = [(c, by[k]) for c in inter if (k := (c.choice, tuple(c.starts), tuple(c.strat))) in by]
    assert same and all(c.time < ref.time for c, ref in same)
    assert all(c.virtual == 1 for c in res.ranked if c.schedule == "1f1b")
