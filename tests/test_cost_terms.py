"""Cost-model terms measured on the live cluster: collective fits priced on each
group's own links, the per-call cost of a collective, block compute affine in the
rows, and a profile averaged over nodes of different speeds taken to speed 1.0."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from oases.planner.cluster import CommModel, grad_groups, load_cluster, reshard_groups, tp_groups
from oases.planner.cost import CostModel, ModelShape, Profile, RunShape
from oases.planner.fit import analytic_profile
from oases.planner.stages import Job, StageLinks, at_rows, build, enumerate_choices, profile_run
from tests.support.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]
HETERO = load_cluster(str(ROOT / "configs/cluster/hetero-4.yaml"))  # {0,1} and {2,3} fast
SHAPE = ModelShape("gpt", 2, 64, 4, 4, 256, 128, 32)
BYTE_S = 8 / 1e9  # seconds per byte at 1 Gbit/s


def test_group_layouts():
    assert tp_groups(2, 4, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grad_groups(1, 2, 2) == [[0, 1, 2, 3]]
    assert grad_groups(2, 4, 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert reshard_groups(1, 2, 2, 1) == [[0, 1]]
    assert reshard_groups(1, 2, 4, 1) == [[0, 1], [2, 3]]


def test_fits_are_priced_on_each_groups_own_links():
    """A fit measured on the fast pairs keeps its alpha and scales its per-byte term by
    the ring's wire time: x5 on a pair across the 0.2 Gbit/s link; a gradient fit over
    four replicas (ring share 1.5, slowest link 0.2) priced for two on a fast pair
    (share 1.0 at 1 Gbit/s) costs 1/7.5 per byte."""
    a, b, n = 1e-3, 2e-8, 1e6
    comm = {"all_reduce": {"2": [a, b]}, "grad_all_reduce": {"1": [a, b]},
            "on": {"tp": 4, "dp": 1}}
    here = CommModel(StageLinks(HETERO, 1), comm)  # a stage whose pair is ranks 1, 2
    assert here.fitted("all_reduce", "2", n, [[0, 1]]) == pytest.approx(a + 5 * b * n)
    same = CommModel(StageLinks(HETERO, 2), comm)  # ranks 2, 3: as fast as measured
    assert same.fitted("all_reduce", "2", n, [[0, 1]]) == pytest.approx(a + b * n)
    root = CommModel(HETERO, comm)
    assert root.fitted("grad_all_reduce", "1", n, [[0, 1]]) == pytest.approx(a + b * n / 7.5)
    # a fit with no record of where it was measured is taken as it is
    legacy = CommModel(StageLinks(HETERO, 1), {"all_reduce": {"2": [a, b]}})
    assert legacy.fitted("all_reduce", "2", n, [[0, 1]]) == pytest.approx(a + b * n)
    assert here.fitted("all_gather", "1-2", n, [[0, 1]]) is None
    # the cost model asks for its own groups: a tp-2 stage on ranks 1, 2 pays the slow link
    run = RunShape(tp=2, dp=1, micro_batch_size=4, grad_accum=1, sub_batches=2,
                   schedule="oases", recompute="fine")
    prof = analytic_profile(SHAPE, run, [1, 2])
    prof = Profile(prof.blocks, prof.constant, comm)
    slow = CostModel(SHAPE, run, StageLinks(HETERO, 1), prof, ranks=[1, 2])
    fast = CostModel(SHAPE, run, StageLinks(HETERO, 2), prof, ranks=[2, 3])
    nbytes = slow._act_bytes(2)
    assert slow.ar_time(2, nbytes) == pytest.approx(a + 5 * b * nbytes)
    assert fast.ar_time(2, nbytes) == pytest.approx(a + b * nbytes)


def test_every_collective_call_pays_the_call_cost():
    """Under oases with fine recompute a degree-T block issues 2 all-reduces per
    sub-batch per micro-batch, and the embedding and head 2 more: with N blocks, G
    micro-batches and 2 sub-batches a step makes (4N + 4) G calls."""
    run = RunShape(tp=2, dp=1, micro_batch_size=4, grad_accum=3, sub_batches=2,
                   schedule="oases", recompute="fine")
    prof = analytic_profile(SHAPE, run, [1, 2])
    c = 2.5e-3
    with_calls = Profile(prof.blocks, prof.constant, {"call_s": c})
    plan = [2] * 4
    t0 = CostModel(SHAPE, run, HETERO, prof).plan_time(plan)
    t1 = CostModel(SHAPE, run, HETERO, with_calls).plan_time(plan)
    assert t1 - t0 == pytest.approx((4 * 4 + 4) * 3 * c)
    # degree 1 blocks issue none; their gradient syncs over the 2 replicas one each
    mixed = [1, 2, 1, 2]
    d = CostModel(SHAPE, run, HETERO, with_calls).plan_time(mixed) - \
        CostModel(SHAPE, run, HETERO, prof).plan_time(mixed)
    assert d > (2 * 4 + 4) * 3 * c  # + the reshard all-gathers and the syncs' calls


def test_pipeline_transfers_pay_two_calls():
    job = Job(SHAPE, global_batch=8, sub_batches=2, schedule="oases", recompute="fine")
    choices = [ch for ch in enumerate_choices(job, 4) if ch.pp == 2 and ch.tp == 2]
    base = profile_run(job, 2, 4)
    prof = analytic_profile(SHAPE, base, [1, 2])
    c = 1e-3
    ch = choices[0]
    x0 = build(job, ch, HETERO, prof, base).inst.x[0][1]
    x1 = build(job, ch, HETERO, Profile(prof.blocks, prof.constant, {"call_s": c}),
               base).inst.x[0][1]
    i = ch.degrees.index(2)
    assert x1[i][i] - x0[i][i] == pytest.approx(2 * c)


def test_block_compute_is_affine_in_the_rows():
    e = {"fwd": 2.0, "fwd2": 3.0, "rows": 1, "rows2": 2}  # a = 1, b = 1 per row
    assert at_rows(e, "fwd", 4.0) == pytest.approx(5.0)
    assert at_rows(e, "fwd", 0.5) == pytest.approx(1.5)
    assert at_rows({"fwd": 2.0, "rows": 1}, "fwd", 4.0) == 8.0  # one point: proportional
    # a second point below the first (noise) is no negative slope: the time stays put
    assert at_rows({"fwd": 2.0, "fwd2": 1.5, "rows": 1, "rows2": 2}, "fwd", 4.0) == 2.0
    # more than proportional (a negative intercept): proportional through the first point
    assert at_rows({"fwd": 1.0, "fwd2": 3.0, "rows": 1, "rows2": 2}, "fwd", 2.0) == 2.0


def _mean_at_speed(ctx):
    from oases.planner.online import rank_mean

    speed = [1.0, 0.5][ctx.rank]
    t = 0.01 / speed  # the half-speed node measures twice the time
    prof = Profile({"attn": {"1": {"fwd": t, "bwd": 2 * t, "fwd2": 3 * t, "bwd2": 4 * t,
                                   "saved": 1, "rows": 1, "rows2": 2}}},
                   {"fwd": t, "bwd": t, "step": t, "head_fwd": t})
    out = rank_mean(prof, ctx, speed)
    e = out.blocks["attn"]["1"]
    assert e["fwd"] == pytest.approx(0.01) and e["bwd2"] == pytest.approx(0.04)
    assert out.constant["step"] == pytest.approx(0.01)


def test_rank_mean_takes_each_node_to_speed_one():
    run_distributed(_mean_at_speed, world=2, tp=1)


def test_own_speed_reads_the_cluster_file():
    from oases.planner.online import own_speed

    cfg = SimpleNamespace(parallel=SimpleNamespace(
        cluster=str(ROOT / "configs/cluster/four-nodes-halfspeed.yaml")))
    assert [own_speed(cfg, r) for r in range(4)] == [1.0, 1.0, 0.5, 0.5]
    assert own_speed(cfg, 7) == 1.0  # beyond the file: the run's check reports that
    assert own_speed(SimpleNamespace(parallel=SimpleNamespace(cluster=None)), 0) == 1.0


def test_sequence_parallel_terms():
    """Under SP the memory row keeps 1/t of what lies outside the TP region (``fine``:
    the input and reduce-scattered chunks, the gathered region input whole; ``full``:
    the input chunk; ``none``: the profiled figure less (1 - 1/t) of the norm input and
    the dropout mask), and each activation collective is two calls of the same bytes."""
    base = dict(tp=4, dp=1, micro_batch_size=8, grad_accum=1, sub_batches=2, schedule="oases")
    c = 2.5e-3
    for rc in ("fine", "full", "none"):
        run, sp = RunShape(**base, recompute=rc), RunShape(**base, recompute=rc,
                                                           sequence_parallel=True)
        prof = analytic_profile(SHAPE, run, [1, 2, 4])
        prof = Profile(prof.blocks, prof.constant, {"call_s": c})
        a, b = CostModel(SHAPE, run, HETERO, prof), CostModel(SHAPE, sp, HETERO, prof)
        act, stream = a._act_bytes(4), a._stream_bytes(4)
        got, want = b.saved_bytes("attn", 4), a.saved_bytes("attn", 4)
        if rc == "fine":
            assert (want, got) == (stream + act, (stream + act) / 4 + act)
        elif rc == "full":
            assert got == want / 4 == stream / 4
        else:
            assert got == pytest.approx(want - 0.75 * (stream + act))
        assert (a.calls(4), b.calls(4), b.calls(1)) == (c, 2 * c, 0.0)
        assert b.plan_time([4] * 4) > a.plan_time([4] * 4)  # more calls, same bytes
        if rc == "fine":  # two sub-batches in step: m exposed per block, over two more calls
            i = 1  # neither the embedding's nor the head's block
            diff = b.node_cost(i, 4) - a.node_cost(i, 4)
            assert diff == pytest.approx(b.m["mlp", 4] + 2 * 2 * c)
            n4 = dict(base, sub_batches=4)  # staggered: only the two more calls
            a4 = CostModel(SHAPE, RunShape(**n4, recompute=rc), HETERO, prof)
            b4 = CostModel(SHAPE, RunShape(**n4, recompute=rc, sequence_parallel=True), HETERO,
                           prof)
            assert b4.node_cost(i, 4) - a4.node_cost(i, 4) == pytest.approx(2 * 4 * c)


def test_sequence_parallel_layouts():
    """The layout search under SP: only a tp that divides the sequence, the choices'
    cost models price SP, and the plan a search writes runs SP at sub-batches its
    degrees can split (auto: four, else two)."""
    from oases.config import load_config
    from oases.planner.auto_layout import plan_divisor
    from oases.planner.online import fit_sub_batches

    shape = ModelShape("gpt", 2, 64, 4, 4, 256, 128, 6)  # seq 6: tp 4 cannot split it
    job = Job(shape, global_batch=8, sub_batches=2, schedule="oases", recompute="fine")
    sp = dataclasses.replace(job, sequence_parallel=True)
    assert {ch.tp for ch in enumerate_choices(job, 4)} == {1, 2, 4}
    assert {ch.tp for ch in enumerate_choices(sp, 4)} == {1, 2}
    ch = next(ch for ch in enumerate_choices(sp, 4) if ch.tp == 2)
    prob = build(sp, ch, HETERO, analytic_profile(shape, profile_run(sp, 2, 4), [1, 2]),
                 profile_run(sp, 2, 4))
    assert all(m.run.sequence_parallel for m in prob.models)
    assert plan_divisor({"tp": 2, "degrees": [2, 1]}) == 2
    assert plan_divisor({"tp": 2, "stages": [{"degrees": [2, 2]}]}) == 1

    def fitted(mbs: int, k: int) -> int:  # auto's four sub-batches, where k parts fit
        cfg = load_config(None, ["model.name=gpt-tiny", "parallel.schedule=oases",
                                 "parallel.tp=2", "parallel.sequence_parallel=true",
                                 f"train.micro_batch_size={mbs}"]).validate(2)
        return fit_sub_batches(cfg, k).sub_batches

    assert (fitted(8, 2), fitted(4, 2), fitted(4, 1)) == (4, 2, 4)


def test_every_sub_batch_is_priced():
    """Without communication (links that take no time) the oases engine's step is its
    compute, whatever the split: one sub-batch of the whole micro-batch, two of half, four
    of a quarter. Block compute linear in the rows through the origin (no fixed part) then
    prices the same step at every count, to rounding. (The model used to count one
    turn per block whatever the count: four sub-batches priced at half the compute.) A
    fixed part per block makes more sub-batches dearer, by one fixed part per block per
    extra sub-batch and pass."""
    fast = dataclasses.replace(HETERO, intra_node_bandwidth_gbps=1e12,
                               inter_node_bandwidth_gbps=1e12, latency_ms=0.0,
                               bandwidth_matrix_gbps=None)
    times = {}
    for n in (1, 2, 4):
        run = RunShape(tp=2, dp=1, micro_batch_size=8, grad_accum=1, sub_batches=n,
                       schedule="oases", recompute="fine")
        prof = analytic_profile(SHAPE, run, [1, 2])
        cm = CostModel(SHAPE, run, fast, prof)
        assert cm.m["attn", 2] < 1e-9  # nothing to hide
        times[n] = cm.plan_time([2] * 4) - cm.constant_time()
        blocks = sum(cm.cf[k, 2] + cm.cb[k, 2] for k in cm.kinds)
        assert times[n] == pytest.approx(n * blocks, rel=1e-6), n
    assert times[1] == pytest.approx(times[2], rel=1e-6) == pytest.approx(times[4], rel=1e-6)


def test_plan_auto_prices_each_sub_batch_count():
    """plan=auto with parallel.sub_batches=auto solves at every count the micro-batch
    takes and keeps the fastest prediction: two where a collective takes as long as a
    segment (one sub-batch would wait for each), one where every collective call costs
    far more than it can hide (a host-bound step)."""
    from oases.config import load_config
    from oases.planner.api import make_plan, run_shape
    from oases.planner.online import planned_sub_batches

    cfg = load_config(None, ["model.name=gpt-tiny", "parallel.schedule=oases",
                             "parallel.recompute=fine", "parallel.tp=2",
                             "train.micro_batch_size=8"]).validate(2)
    run = run_shape(cfg)
    prof = analytic_profile(ModelShape.from_config(cfg.model), run, [1, 2])
    quiet = lambda *a, **k: None  # noqa: E731
    plan, n = planned_sub_batches(make_plan(cfg, HETERO, prof, None, quiet), cfg, HETERO, prof, 1e6,
                           quiet)
    assert n == 2 and plan[0].sub_batches == 2
    costly = Profile(prof.blocks, prof.constant, {"call_s": 1.0})
    plan, n = planned_sub_batches(make_plan(cfg, HETERO, costly, None, quiet), cfg, HETERO, costly,
                           1e6, quiet)
    assert n == 1 and plan[0].sub_batches == 1
