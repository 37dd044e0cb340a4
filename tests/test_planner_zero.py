"""The planner prices ZeRO levels, bf16 weights, the gradient-sum dtype and the secondary
shard, and ``parallel.zero_search`` lets the layout search choose them per layout.

Analytic profiles on cluster files in code (no measurement), as tests/test_layout_search.py
does: every figure is the cost model's own, so the checks are exact where they compare
rows and qualitative where they compare choices (a choice the search makes must be the
one the rows make cheapest)."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from oases.config import load_config
from oases.errors import ConfigError
from oases.planner import stages as st
from oases.planner.cluster import Cluster
from oases.planner.cost import ModelShape
from oases.planner.fit import analytic_profile
from oases.planner.search import search
from oases.planner.zero_cost import zero_memory

SHAPE = ModelShape("gpt", 4, 256, 8, 8, 1024, 512, 64)
QUIET = dict(log=lambda s: None)


def _setup(job, world=4, base_tp=1, flops=5e9):
    base = st.profile_run(job, base_tp, 8)
    prof = analytic_profile(job.shape, base, job.shape.valid_degrees(base_tp), flops)
    return base, prof


def _model(job, cluster, key, base, prof):
    ch = next(c for c in st.enumerate_choices(job, cluster.world)
              if (c.pp, c.dp, c.tp, c.micro_batches, c.zero, c.secondary) == key)
    return st.build(job, ch, cluster, prof, base).models[0], ch


@pytest.mark.parametrize("weight_bytes", [4, 2])
def test_a_blocks_memory_row_is_zero_costs(weight_bytes):
    """A block's bytes held between steps at each level equal zero_memory's rows for
    the parameters a rank holds, over its gradient group (dp x the block's replicas);
    bf16 weights add the master row and drop the bf16 copy of the matrices."""
    job = st.Job(SHAPE, 8, 1, "megatron", "none", act_bytes=2, weight_bytes=weight_bytes,
                 zero_levels=(0, 1, 2, 3))
    cluster = Cluster("c", 1, 4, 80.0, 100.0, 100.0)
    base, prof = _setup(job)
    for z in (0, 1, 2, 3):
        cm, ch = _model(job, cluster, (1, 4, 1, 1, z, 0), base, prof)
        n = job.shape.rank_params("mlp", 1)
        rows = zero_memory(n, 4, z, 4, weight_elem=2 if weight_bytes == 2 else None)
        cast = 0 if weight_bytes == 2 else 2 * job.shape.matrix_params("mlp")
        static = cm.mem["mlp", 1] - cm.run.sub_batches * cm.saved_bytes("mlp", 1)
        assert static == pytest.approx(sum(rows.values()) + cast), (z, rows)
    assert zero_memory(n, 4, 0, 4)["params"] == 4 * n  # 16 B per parameter at level 0


def test_gathers_and_reductions_are_priced_per_level():
    """On a slow link: level 1 adds the post-step gather to level 0's all-reduce (once
    per step), level 2 reduce-scatters instead (half the ring's bytes), level 3 gathers
    before each forward and backward (per micro-batch); bf16 weights halve the post-step
    gather, a bf16 gradient sum the reduction."""
    cluster = Cluster("slow", 2, 2, 80.0, 100.0, 0.5)  # dp 4 spans the 0.5 Gbit/s link
    rows = {}
    for wb, rb in ((4, 4), (2, 4), (4, 2)):
        job = st.Job(SHAPE, 8, 1, "megatron", "none", weight_bytes=wb, grad_reduce_bytes=rb,
                     zero_levels=(0, 1, 2, 3), reduce_options=(rb,))
        base, prof = _setup(job, flops=5e12)  # fast compute: the link shows
        for z in (0, 1, 2, 3):
            cm, _ = _model(job, cluster, (1, 4, 1, 1, z, 0), base, prof)
            rows[wb, rb, z] = (cm.sync["mlp", 1], cm.zstep["mlp", 1], cm.zmb["mlp", 1])
    f = rows[4, 4, 0][0]
    assert rows[4, 4, 1][0] == f and rows[4, 4, 1][1] > 0.2 * f  # + a gather of n x 4 B
    assert rows[4, 4, 2][0] == pytest.approx(f / 2, rel=0.05) and rows[4, 4, 2][2] == 0.0
    assert rows[4, 4, 3][2] > 0 and rows[4, 4, 3][1] == 0.0
    assert rows[2, 4, 1][1] == pytest.approx(rows[4, 4, 1][1] / 2, rel=0.05)  # bf16 weights
    assert rows[4, 2, 0][0] == pytest.approx(f / 2, rel=0.05)                 # bf16 sums


def test_zero_search_shards_only_when_memory_demands_it():
    """With room, the search keeps ZeRO-0 (every level adds traffic); with a memory limit
    that level 0 cannot meet, it takes the lowest level that fits, where the search
    without ``zero_search`` finds no layout at all."""
    cluster = Cluster("c", 1, 4, 80.0, 100.0, 100.0)
    job = st.Job(SHAPE, 8, 1, "megatron", "none")
    searched = dataclasses.replace(job, zero_levels=(0, 1, 2, 3))
    base, prof = _setup(job, base_tp=4)
    free = search(searched, 4, cluster, prof, base, **QUIET)
    assert free.best.choice.zero == 0
    # just below what the best level-0 layout needs: 16 B of state per parameter
    level0 = search(job, 4, cluster, prof, base, **QUIET)
    limit = 0.97 * max(level0.best.memory)
    got = search(searched, 4, cluster, prof, base, memory_limit=limit, **QUIET).best
    ch = got.choice
    assert ch.zero >= 1 and max(got.memory) <= limit, got.describe()
    # the same layout at level 0 does not fit: it was sharded because it had to be
    prob = st.build(searched, dataclasses.replace(ch, zero=0), cluster, prof, base,
                    memory_limit=limit)
    assert max(prob.memory(got.starts, got.strat)) > limit


def test_the_secondary_shard_is_chosen_across_a_slow_link():
    """dp 4 on two nodes of two joined at 0.2 Gbit/s, at level 3: the node shard keeps
    the forward and backward gathers inside the node, so the search's dp-4 layouts take
    it; the plan file records it."""
    from oases.planner.report import to_plan

    cluster = Cluster("two-nodes", 2, 2, 80.0, 100.0, 0.2)
    job = st.Job(SHAPE, 8, 1, "megatron", "none", zero_levels=(3,), secondary="search",
                 node_ranks=2)
    base, prof = _setup(job)
    res = search(job, 4, cluster, prof, base, **QUIET)
    dp4 = [c for c in res.ranked if c.choice.dp == 4]  # (pp 2 keeps each DP group in a node)
    best = dp4[0]
    assert best.choice.zero == 3 and best.choice.secondary == 2, best.describe()
    plain = next(c for c in dp4 if not c.choice.secondary)
    assert plain.time > best.time
    cfg = load_config(None, ["model.name=gpt-tiny", "model.n_layer=4", "data.kind=synthetic",
                             "parallel.plan=auto", "parallel.plan_search=uniap",
                             "parallel.zero_search=true", "parallel.cluster=x.yaml",
                             "parallel.schedule=megatron", "parallel.recompute=none"])
    plan = to_plan(best, res, cfg, cluster.name)
    assert plan.zero == [3] * 10 and plan.zero_secondary == "node"
    assert plan.grad_reduce_dtype == "fp32"


def test_plan_file_with_zero_runs_as_priced(tmp_path):
    """A plan the search wrote with ZeRO-3 and the node shard: the run's config takes
    its level, shard and gradient-sum dtype (and validates)."""
    from oases.planner.auto_layout import pointed_at

    plan = {"degrees": [1] * 10, "tp": 1, "model": {}, "zero": [3] * 10,
            "micro_batch_size": 2, "micro_batches": 1, "pp": 1, "zero_secondary": "node",
            "grad_reduce_dtype": "bf16"}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    cfg = load_config(None, ["model.name=gpt-tiny", "data.kind=synthetic",
                             "parallel.plan=auto", "parallel.plan_search=uniap",
                             "parallel.zero_search=true", "parallel.grad_reduce_dtype=auto",
                             "train.micro_batch_size=2", "parallel.schedule=megatron",
                             "parallel.recompute=none"])
    run = pointed_at(cfg, path, 4)
    p = run.parallel
    assert (p.zero, p.zero_secondary, p.grad_reduce_dtype, p.zero_search) == (
        3, "node", "bf16", False)
    run.validate(4)


def test_reduce_auto_takes_bf16_sums_on_a_slow_link():
    """``grad_reduce_dtype=auto`` prices both sums; on a link where the reduction is
    exposed the bf16 one is faster, and the search takes it."""
    cluster = Cluster("slow", 2, 2, 80.0, 100.0, 0.2)
    job = st.Job(SHAPE, 8, 1, "megatron", "none", reduce_options=(4, 2))
    base, prof = _setup(job)
    res = search(job, 4, cluster, prof, base, **QUIET)
    assert res.best.choice.reduce_bytes == 2 or res.best.choice.dp == 1, res.best.describe()
    dp4 = [c for c in res.ranked if c.choice.dp == 4]
    by = {c.choice.reduce_bytes: c.time for c in dp4}
    assert by[2] < by[4]


@pytest.mark.parametrize("override", ["parallel.zero_search=true",
                                      "parallel.grad_reduce_dtype=auto"])
def test_searched_settings_need_the_layout_search(override):
    with pytest.raises(ConfigError, match="need parallel.plan=auto, plan_search=uniap"):
        load_config(None, ["model.name=gpt-tiny", override]).validate(1)
