"""The planner's count of NCCL communicators per layout and the memory it takes off a
plan's limit (oases.planner.comm_memory). Pure: the live counts are checked against the
same function in tests/test_comm_groups.py."""

from __future__ import annotations

import itertools
import random

import pytest

from oases.errors import UserError
from oases.planner import ilp
from oases.planner import stages as st
from oases.planner.api import make_plan
from oases.planner.cluster import Cluster, load_cluster, usable_bytes
from oases.planner.comm_memory import (COMM_BYTES, GIB, CommLayout, choice_bytes, communicators,
                                       config_bytes, for_backend, pp1_bytes, pp1_layout,
                                       stage_counts)
from oases.planner.cost import CostModel, ModelShape, Profile, RunShape
from oases.planner.fit import analytic_profile

NCCL = Cluster("g", 2, 4, 80, 100, 10, nccl_communicator_gib=0.5)


def test_communicators_per_rank_of_each_layout():
    # pp = 1: one-rank groups are none, an every-rank group is the world's
    assert communicators(pp1_layout(8, 1, False)) == [1] * 8
    assert communicators(pp1_layout(1, 8, False)) == [1] * 8
    assert communicators(pp1_layout(1, 8, False, high_priority_tp=True)) == [2] * 8
    assert communicators(pp1_layout(2, 4, False)) == [3] * 8
    # per-block degrees: the degree-2 subgroup, (2, 4) resharding, degree-2 gradients
    assert communicators(pp1_layout(2, 4, True)) == [6] * 8
    # GQA at one kv head: the kv replica group is the TP group; at 2 of 4 a group of 2 more
    assert communicators(pp1_layout(2, 4, False, kv_heads=1)) == [3] * 8
    assert communicators(pp1_layout(2, 4, False, kv_heads=2)) == [4] * 8
    # pipelines: the world, TP, each boundary's two directions; fan-out = TP
    pp4 = CommLayout(((1, 2),) * 4, (False,) * 4)
    assert communicators(pp4) == [4, 4, 6, 6, 6, 6, 4, 4]
    assert stage_counts(pp4) == [4, 6, 6, 4]
    tied = CommLayout(((1, 2),) * 4, (False,) * 4, tie_embeddings=True)
    assert communicators(tied) == [5, 5, 6, 6, 6, 6, 5, 5]
    # stages of their own layouts: one tie group over both when their tp differ (its
    # ranks are the world's, and the p2p groups', but it is none of them); stage 1 has DP
    assert communicators(CommLayout(((1, 4), (2, 2)), (False, False), True)) == \
        [5] * 4 + [6] * 4
    # one rank per stage: p2p only (the tie group is its own, as the runtime's)
    assert communicators(CommLayout(((1, 1),) * 2, (False,) * 2, True)) == [4, 4]
    # "send" has no fan-out, nor sequence-sharded transfers: the same count here
    for kw in ({"transfer": "send"}, {"sequence_parallel": True}):
        assert communicators(CommLayout(((2, 2),) * 2, (False,) * 2, **kw)) == [5] * 8


def test_a_communicator_costs_gpu_memory_on_nccl_only():
    base = Cluster("c", 1, 8, 80, 100, 10)
    assert for_backend(base, "gloo").nccl_communicator_gib == 0.0
    assert for_backend(base, "nccl").nccl_communicator_gib * GIB == pytest.approx(COMM_BYTES)
    assert for_backend(NCCL, "nccl").nccl_communicator_gib == 0.5  # the file's figure
    assert for_backend(NCCL, "gloo").nccl_communicator_gib == 0.0
    assert pp1_bytes(base, 2, 4) == (0.0, 0.0)  # unresolved: nothing counted
    # dp 2 x tp 4: 3 communicators; per-block degrees add 3
    assert pp1_bytes(NCCL, 2, 4) == (1.5 * GIB, 1.5 * GIB)


def test_the_cluster_file_may_set_the_figure(tmp_path):
    text = ("name: c\nnodes: 1\ndevices_per_node: 2\ndevice_memory_gib: 80\n"
            "intra_node_bandwidth_gbps: 100\ninter_node_bandwidth_gbps: 10\n")
    ok = tmp_path / "ok.yaml"
    ok.write_text(text + "nccl_communicator_gib: 1.25\n")
    assert load_cluster(str(ok)).nccl_communicator_gib == 1.25
    bad = tmp_path / "bad.yaml"
    bad.write_text(text + "nccl_communicator_gib: -1\n")
    with pytest.raises(UserError, match=r"nccl_communicator_gib=-1 must be a number >= 0"):
        load_cluster(str(bad))


def test_layout_search_limits_leave_room_for_the_communicators():
    """Each stage's derived limit loses its ranks' communicators (a stage that may take
    degrees below tp with its degree groups); an explicit limit is taken as given."""
    job = st.Job(ModelShape("gpt", 4, 256, 8, 8, 1024, 512, 64), 8, 2, "megatron", "none")
    base = st.profile_run(job, 2, 8)
    prof = analytic_profile(job.shape, base, job.shape.valid_degrees(2), 5e9)
    ch = next(c for c in st.enumerate_choices(job, 8) if c.pp == 4 and c.tp == 2)
    assert set(ch.degrees) == {1, 2}
    comms = choice_bytes(job, ch, NCCL)
    # world, TP, 2 or 4 p2p, the tie group on the ends (at dp 1 the degree groups are all
    # the TP group: (1, 2) resharding, degree 1's gradients)
    assert [c / (0.5 * GIB) for c in comms] == [5, 6, 6, 5]
    dp2 = next(c for c in st.enumerate_choices(job, 8) if c.pp == 2 and c.dp == 2)
    assert dp2.tp == 2 and set(dp2.degrees) == {1, 2}
    # + DP, and degree 1's gradient group (the stage's 4 ranks)
    assert [c / (0.5 * GIB) for c in choice_bytes(job, dp2, NCCL)] == [7, 7]
    for limit, want in ((None, [usable_bytes(80 * GIB) - c for c in comms]),
                        (30 * GIB, [30 * GIB] * 4)):
        prob = st.build(job, ch, NCCL, prof, base, limit)
        got = [lim + k for lim, k in zip(prob.inst.memory_limit, prob.memory_const)]
        assert got == pytest.approx(want)


def _cost_model():
    shape = ModelShape("gpt", 3, 256, 8, 8, 1024, 512, 64)
    run = RunShape(4, 1, 8, 1, 2, "oases", "fine")
    rng = random.Random(3)
    blocks = {k: {str(t): {"fwd": rng.uniform(1e-3, 2e-2), "bwd": rng.uniform(2e-3, 4e-2),
                           "saved": rng.uniform(1e6, 4e7)} for t in (1, 2, 4)}
              for k in ("attn", "mlp")}
    prof = Profile(blocks, {"fwd": 1e-3, "bwd": 2e-3, "step": 1e-3, "peak": 1e6})
    return CostModel(shape, run, Cluster("c", 1, 4, 80, 100, 10), prof)


def test_the_ilp_charges_degree_groups_to_plans_below_tp_only():
    cm = _cost_model()
    free = ilp.brute_force(cm)
    assert set(free.degrees) != {4}  # the fastest plan mixes degrees
    uniform = cm.plan_memory([4] * cm.n)
    limit = max(free.memory_bytes, uniform) * 1.01
    # degree groups worth more than the room any plan below tp leaves: only tp's fits
    lo = min(cm.plan_memory(list(p)) for p in itertools.product(cm.degrees, repeat=cm.n)
             if set(p) != {4})
    mixed = limit - lo + 1.0
    for got in (ilp.solve(cm, limit, mixed=mixed), ilp.brute_force(cm, limit, mixed=mixed)):
        assert got.degrees == [4] * cm.n
    assert ilp.best_uniform(cm, limit, mixed=mixed).degrees == [4] * cm.n
    # room for them: the ILP is the brute force's, mixed plans allowed again
    small = 0.001 * limit
    assert ilp.solve(cm, limit, mixed=small).time_s == pytest.approx(
        ilp.brute_force(cm, limit, mixed=small).time_s, rel=1e-9)
    assert ilp.solve(cm, limit, mixed=small).degrees == free.degrees
    with pytest.raises(UserError, match="no plan fits"):  # nothing fits at all
        ilp.solve(cm, ilp.min_memory(cm, mixed) * 0.5, mixed=mixed)


def test_make_plan_takes_the_runs_communicators_off_the_limit():
    from oases.config import load_config

    cfg = load_config(None, ["model.name=gpt-tiny", "parallel.tp=4"]).validate(8)
    nccl = for_backend(Cluster("c", 1, 8, 80, 100, 10), "nccl")
    comm = config_bytes(cfg, nccl, "nccl")
    # world, TP, DP; below tp the degree-2 subgroup, (2, 4) resharding, degree-2 gradients
    assert comm == (3 * COMM_BYTES, 3 * COMM_BYTES)
    shape = ModelShape.from_config(cfg.model)
    from oases.planner.api import run_shape

    prof = analytic_profile(shape, run_shape(cfg), shape.valid_degrees(4), 5e9)
    plan, cm, _ = make_plan(cfg, nccl, prof, 80 * GIB, comm=comm)
    held = comm[0] + (comm[1] if set(plan.degrees) != {4} else 0.0)
    assert plan.predicted["communicators_gib"] == pytest.approx(held / GIB)
    # a limit that fits the tensors but not them as well: no plan
    need = ilp.min_memory(cm)
    with pytest.raises(UserError, match="no plan fits"):
        make_plan(cfg, nccl, prof, need + comm[0] / 2, comm=comm)
    make_plan(cfg, nccl, prof, need + comm[0] + comm[1], comm=comm)  # room for them: fits
