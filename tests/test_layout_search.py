"""Planner v2: instances built from a profile and a cluster, the layout search against
brute force, the CLI (``--search uniap|amp|tp-only``) and a run of the plan it writes."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import yaml

from oases.config import load_config
from oases.errors import ConfigError, UserError
from oases.planner import stages as st
from oases.planner.cluster import Cluster, load_cluster
from oases.planner.cost import CostModel, ModelShape
from oases.planner.fit import analytic_profile
from oases.planner.online import resolve_layout
from oases.planner.plan_file import check_plan, check_run, load_plan
from oases.planner.profile import profile_key, save_db
from oases.planner.search import CHOOSABLE, search
from oases.planner.uniap import evaluate

SHAPE = ModelShape("gpt", 4, 256, 8, 8, 1024, 512, 64)


def _problem(job, cluster, world, key, base_tp=4, flops=5e9, **kw):
    base = st.profile_run(job, base_tp, 8)
    prof = analytic_profile(job.shape, base, job.shape.valid_degrees(base_tp), flops)
    ch = next(c for c in st.enumerate_choices(job, world)
              if (c.pp, c.dp, c.tp, c.micro_batches) == key)
    return st.build(job, ch, cluster, prof, base, **kw), prof, base


def _stage_model(job, ch, cluster, prof, base, first=0):
    """The CostModel the builder should use for a stage: one micro-batch of ch.rows."""
    run = job.run(ch.tp, ch.dp, ch.rows)
    return CostModel(job.shape, run, st.StageLinks(cluster, first),
                     st.scale_profile(prof, base, run, job.shape), list(ch.degrees),
                     ranks=list(range(first, first + ch.dp * ch.tp)))


@pytest.mark.parametrize("schedule,recompute", [("oases", "fine"), ("megatron", "none")])
def test_instance_prices_a_plan_as_the_cost_model(schedule, recompute):
    """pp = 1, dp = 1, one micro-batch: the instance's time of any per-layer degree plan
    is the cost model's step time (whose edges the builder cut in two), except that a
    layer's replica gradient syncs hide behind its own backward only, not the queue's."""
    job = st.Job(SHAPE, 8, 2, schedule, recompute)
    cluster = Cluster("c", 2, 2, 4, 10.0, 1.0)
    prob, prof, base = _problem(job, cluster, 4, (1, 1, 4, 1))
    ch = prob.choice
    assert ch.degrees == (1, 2, 4) and ch.rows == 8
    cm = _stage_model(job, ch, cluster, prof, base)
    for strat in ([2, 2, 2, 2], [0, 1, 2, 0], [2, 0, 0, 1]):
        blocks = [ch.degrees[s] for s in strat for _ in (0, 1)]
        # per layer, what outlasts its own backward (the stages' linear hiding)
        syncs = sum(max(0.0, sum(cm.sync[k, ch.degrees[s]] - cm.free[k, ch.degrees[s]]
                                 for k in ("attn", "mlp"))) for s in strat)
        full = sum(cm.sync[k, d] for k, d in zip(cm.kinds, blocks))
        assert syncs < full or strat == [2, 2, 2, 2]  # degree < 4: syncs, partly hidden
        want = cm.plan_time(blocks) - cm.sync_exposed(blocks) + syncs
        assert prob.time([0], strat) == pytest.approx(want, rel=1e-12)
        assert prob.memory([0], strat)[0] == pytest.approx(cm.plan_memory(blocks) - max(
            cm.trans[k, d] for k, d in zip(cm.kinds, blocks)) + max(cm.trans.values()))
    assert prob.constant == 0.0  # the analytic profile has no optimizer step


def test_instance_stage_costs_transfers_speed_and_memory():
    """pp = 4 on hetero-4 (pairs of nodes at 1 Gbit/s, 0.2 between the pairs): the cut
    between the pairs pays 5x the transfer inside a pair; a half-speed node doubles
    its stage's compute; the last stage carries the head, stage 0 the embedding; 1F1B
    keeps 4, 3, 2, 1 micro-batches in flight."""
    cluster = load_cluster("configs/cluster/hetero-4.yaml")
    job = st.Job(SHAPE, 8, 2, "megatron", "none")
    prob, prof, base = _problem(job, cluster, 4, (4, 1, 1, 8))
    inst, ch = prob.inst, prob.choice
    assert ch.rows == 1 and inst.strategies == ["tp1"]
    nbytes = 1 * SHAPE.seq_len * SHAPE.d_model * 4
    assert inst.x[0][1][0][0] == pytest.approx(2 * nbytes / (1.0e9 / 8))
    assert inst.x[1][2][0][0] == pytest.approx(2 * nbytes / (0.2e9 / 8))
    assert inst.x[2][3][0][0] == pytest.approx(inst.x[0][1][0][0])
    cm = _stage_model(job, ch, cluster, prof, base)
    assert inst.t[1][1][0] == pytest.approx(cm.node_cost(2, 1) + cm.node_cost(3, 1))
    assert inst.t[3][3][0] == pytest.approx(inst.t[1][1][0] + cm.constant_time())
    assert [inst.in_flight(p) for p in range(4)] == [4, 3, 2, 1]
    emb = 16 * (SHAPE.vocab_size + SHAPE.seq_len) * SHAPE.d_model
    # logits: 1 row of the profiled 8, the whole vocabulary rather than a quarter (tp 4)
    head = 16 * (SHAPE.vocab_size + 2) * SHAPE.d_model + prof.constant["peak"] / 8 * 4
    assert prob.memory_const[0] == pytest.approx(emb)
    assert prob.memory_const[3] == pytest.approx(head)
    assert prob.memory_const[1] == prob.memory_const[2] == 0.0

    slow = load_cluster("configs/cluster/hetero-4.yaml")
    slow.node_speed = [1.0, 1.0, 0.5, 1.0]  # node 2 computes at half speed
    sp, _, _ = _problem(job, slow, 4, (4, 1, 1, 8))
    assert sp.inst.t[2][2][0] == pytest.approx(2 * inst.t[2][2][0])  # tp 1: compute only
    assert sp.inst.t[1][1][0] == pytest.approx(inst.t[1][1][0])


def _brute(problems):
    """Every choice x contiguous placement x per-layer degree that fits."""
    best = math.inf
    for prob in problems:
        inst = prob.inst
        for cuts in itertools.combinations(range(1, inst.L), inst.stages - 1):
            for strat in itertools.product(range(inst.S), repeat=inst.L):
                starts = [0, *cuts]
                t, mem = evaluate(inst, starts, strat)
                if all(m <= lim for m, lim in zip(mem, inst.memory_limit)):
                    best = min(best, t + prob.constant)
    return best


def test_search_equals_brute_force_and_beats_amp():
    """World 4 (2 nodes x 2), 4 layers, global batch 16, megatron: under 0.4 of the
    memory the fastest layout needs without a limit, the MILP's pick equals brute force
    over (pp, dp, tp, c, partition, degree per layer) and mixes degrees, beating AMP's
    uniform pick, which beats (or ties) the Megatron-style layout."""
    job = st.Job(SHAPE, 16, 2, "megatron", "none")
    cluster = Cluster("c", 2, 2, 4, 10.0, 2.0)
    base = st.profile_run(job, 4, 8)
    prof = analytic_profile(SHAPE, base, [1, 2, 4], 5e9)
    quiet = dict(log=lambda s: None)
    free = search(job, 4, cluster, prof, base, **quiet)
    limit = 0.4 * max(free.best.memory)
    res = search(job, 4, cluster, prof, base, gap=1e-9, budget_s=30, memory_limit=limit, **quiet)
    problems = [st.build(job, ch, cluster, prof, base, limit)
                for ch in st.enumerate_choices(job, 4, 4)]
    assert res.best.time == pytest.approx(_brute(problems), rel=1e-9)
    assert res.best.source == "uniap" and len(set(res.best.degrees)) > 1
    assert res.best.time < res.amp.time * (1 - 1e-3)
    assert res.amp.time <= res.megatron.time
    assert all(m <= limit * (1 + 1e-9) for m in res.best.memory)
    amp_only = search(job, 4, cluster, prof, base, method="amp", memory_limit=limit, **quiet)
    assert amp_only.best.time == pytest.approx(res.amp.time) and amp_only.milps == 0
    times = [c.time for c in res.ranked]
    assert times == sorted(times) and len({c.key() for c in res.ranked}) == len(times)


def test_milp_never_worse_than_amp_per_layout():
    """On every layout with a choice of degrees, the MILP (started from AMP's plan for
    that layout) is no slower than AMP's plan on the cost model, across schedules and
    memory limits; and the search's pick is no slower than AMP's pick."""
    from oases.planner.search import solve_milp, amp_plan

    cluster = Cluster("c", 2, 2, 4, 10.0, 0.5)
    solved = 0
    for sched, rc, frac in [("oases", "fine", None), ("oases", "fine", 0.7),
                            ("megatron", "none", 0.7), ("megatron", "none", 0.5)]:
        job = st.Job(SHAPE, 16, 2, sched, rc)
        base = st.profile_run(job, 4, 8)
        prof = analytic_profile(SHAPE, base, [1, 2, 4], 5e9)
        free = search(job, 4, cluster, prof, base, log=lambda s: None)
        limit = frac and frac * max(free.best.memory)
        for ch in st.enumerate_choices(job, 4, 4):
            prob = st.build(job, ch, cluster, prof, base, limit)
            start = amp_plan(prob)
            if prob.inst.S < 2 or start is None:
                continue
            got = solve_milp(prob, start, 2.0, 1e-9)
            assert got is not None and got.time <= start.time * (1 + 1e-9), ch
            solved += 1
        res = search(job, 4, cluster, prof, base, memory_limit=limit, log=lambda s: None)
        assert res.best.time <= res.amp.time
    assert solved >= 20  # layouts with a degree to choose and an AMP plan


def test_milp_keeps_its_time_limit_on_32_layers():
    """A 32-layer GPT on 16 devices (pp 4 x tp 4, 16 micro-batches, 20 GiB): the MILP,
    warm started from AMP's plan, returns within a few times its 0.5 s limit. Memory
    rows in bytes (1e10) beside times (1e-3) kept CBC in its start-up for 47 s here."""
    import time

    from oases.planner import uniap
    from oases.planner.search import amp_plan

    shape = ModelShape("gpt", 32, 2048, 16, 16, 8192, 50257, 2048)
    job = st.Job(shape, 64, 2, "oases", "fine")
    cluster = Cluster("c", 2, 8, 20, 1200.0, 100.0)
    prob, _, _ = _problem(job, cluster, 16, (4, 1, 4, 16), base_tp=8, flops=300e12)
    start = amp_plan(prob)
    t0 = time.perf_counter()
    got = uniap.solve(prob.inst, time_limit=0.5, gap=0.01, start=(start.starts, start.strat))
    assert time.perf_counter() - t0 < 5.0
    assert got.time + prob.constant <= start.time * (1 + 1e-9)


# ---- the CLI ----

TINY = ["model.d_model=64", "model.n_head=4", "model.n_kv_heads=4", "model.ffn_hidden=128",
        "model.seq_len=32", "parallel.tp=1", "train.micro_batch_size=2", "train.grad_accum=2",
        "parallel.schedule=megatron", "parallel.recompute=none"]
CLUSTER = """name: pairs
nodes: 2
devices_per_node: 2
device_memory_gib: 4
intra_node_bandwidth_gbps: 10.0
inter_node_bandwidth_gbps: 0.5
"""


def _fabricated_db(tmp_path, overrides, tp_max=2, search_kind="uniap"):
    """A profile DB holding the analytic profile under the key the CLI will look up, at
    the degrees the profiler measures (those whose batch parts hold whole sequences)."""
    from oases.planner.api import run_shape

    cfg = load_config("configs/gpt-tiny.yaml", overrides).validate(4)
    job = st.job_from_config(cfg)
    base = (run_shape(cfg) if search_kind == "tp-only" else
            st.profile_run(job, tp_max, cfg.train.micro_batch_size))
    rows = base.micro_batch_size // base.sub_batches
    degrees = [t for t in job.shape.valid_degrees(base.tp) if rows * t % base.tp == 0]
    prof = analytic_profile(job.shape, base, degrees, 1e9)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    db = tmp_path / "db.json"
    save_db(db, {profile_key(device, job.shape, base, "fp32"):
                 {"blocks": prof.blocks, "constant": prof.constant}})
    return db


def _cli(tmp_path, capsys, search_kind, *extra, overrides=TINY, cluster=CLUSTER):
    from oases.cli.plan import main

    (tmp_path / "cluster.yaml").write_text(cluster)
    db = _fabricated_db(tmp_path, overrides, search_kind=search_kind)
    rc = main(["--config", "configs/gpt-tiny.yaml", "--cluster", str(tmp_path / "cluster.yaml"),
               "--profile", str(db), "--out", str(tmp_path / "plan.yaml"), "--search",
               search_kind, "--max-tp", "2", *extra, *overrides])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _run_cfg(plan_path, overrides, world=4):
    plan = load_plan(str(plan_path))
    run = plan.predicted["run"].split() if plan.micro_batches else []
    return load_config("configs/gpt-tiny.yaml", overrides + run + [
        f"parallel.plan={plan_path}"]).validate(world), plan


@pytest.mark.parametrize("kind", ["uniap", "amp"])
def test_cli_searches_write_plans_the_runtime_accepts(tmp_path, capsys, kind):
    rc, out, err = _cli(tmp_path, capsys, kind, "--memory-gib", "0.0015", "--trials", "2")
    assert rc == 0, err
    assert "predicted time per iteration" in out and "best uniform layout" in out
    assert "AMP's pick" in out and f"search {kind}:" in out and "run it: torchrun" in out
    for name in ("plan.yaml", "plan-2.yaml"):
        cfg, plan = _run_cfg(tmp_path / name, TINY)
        if plan.pp > 1:
            layout = resolve_layout(cfg, 4)
            assert layout.pp == plan.pp and [s.tp for s in layout.stages] == [plan.tp] * plan.pp
        else:
            check_run(plan, cfg)
            assert len(check_plan(plan, cfg.model, cfg.parallel.tp)) == 2 * cfg.model.n_layer
    first, second = (load_plan(str(tmp_path / n)) for n in ("plan.yaml", "plan-2.yaml"))
    assert first.predicted["step_time_s"] <= second.predicted["step_time_s"]
    assert first.pp == 2 and first.stages[1]["layers"][1] == 4  # the memory limit: pipelined
    assert (tmp_path / "plan.png").stat().st_size > 1000
    # the wrong batch for a searched plan: one line naming the overrides that run it
    cfg, _ = _run_cfg(tmp_path / "plan.yaml", TINY)
    cfg.train.grad_accum += 1
    with pytest.raises(UserError, match=r"was made for parallel.pp=2 .*train.grad_accum=\d+ "
                                        r"parallel.pp_schedule=\S+; this run has "
                                        r"train.grad_accum"):
        resolve_layout(cfg, 4)
    # the pipeline schedule is chosen with the layout: recorded, run, and enforced
    plan = load_plan(str(tmp_path / "plan.yaml"))
    assert plan.pp_schedule in CHOOSABLE, plan.pp_schedule
    assert f"parallel.pp_schedule={plan.pp_schedule}" in plan.predicted["run"].split()
    cfg, _ = _run_cfg(tmp_path / "plan.yaml", TINY)
    other = "gpipe" if plan.pp_schedule != "gpipe" else "1f1b"
    cfg.parallel.pp_schedule = other
    with pytest.raises(UserError, match=rf"parallel.pp_schedule={plan.pp_schedule}; this run "
                                        rf"has parallel.pp_schedule={other}"):
        resolve_layout(cfg, 4)


def test_cli_tp_only_and_bad_input(tmp_path, capsys):
    # the config's layout: tp 2, one sequence per sub-batch, so degree 1 (which halves
    # it) is neither profiled nor a candidate
    rc, out, err = _cli(tmp_path, capsys, "tp-only", overrides=TINY[:5] + ["parallel.tp=2"]
                        + TINY[6:])
    assert rc == 0, err
    assert "best uniform plan" in out and load_plan(str(tmp_path / "plan.yaml")).degrees == [2] * 8
    rc, out, err = _cli(tmp_path, capsys, "uniap", cluster=CLUSTER.replace("nodes: 2\n", ""))
    assert rc == 2 and err.count("\n") == 1 and "missing key(s) nodes" in err
    rc, out, err = _cli(tmp_path, capsys, "amp", "--memory-gib", "0.0001")
    assert rc == 2 and err.count("\n") == 1 and "no layout found that fits" in err
    bad = TINY[:1] + ["model.n_head=3"] + TINY[2:]
    with pytest.raises(ConfigError):  # what the CLI reports for it (below): one line
        load_config("configs/gpt-tiny.yaml", bad).validate(4)
    from oases.cli.plan import main
    rc = main(["--config", "configs/gpt-tiny.yaml", "--cluster", str(tmp_path / "cluster.yaml"),
               "--out", str(tmp_path / "p.yaml"), *bad])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "n_head" in err


@pytest.mark.slow
def test_written_pipeline_plan_trains(tmp_path, capsys, run_train):
    """The plan ``--search uniap`` writes under a tight memory limit (pp 2 x tp 2 on
    world 4) runs through ``torchrun train.py`` with the overrides the CLI prints, on
    gloo, for 2 steps."""
    rc, out, err = _cli(tmp_path, capsys, "uniap", "--memory-gib", "0.0015")
    assert rc == 0, err
    plan = load_plan(str(tmp_path / "plan.yaml"))
    assert plan.pp == 2
    run = out.split("run it: ")[1].split()
    overrides = run[run.index(f"parallel.plan={tmp_path / 'plan.yaml'}"):]
    assert set(plan.predicted["run"].split()) <= set(overrides)
    proc = run_train(["--config", "configs/gpt-tiny.yaml", *overrides, "train.steps=2",
                      "train.log_interval=1",
                      f"out_dir={tmp_path / 'run'}", "data.kind=synthetic", "data.val_path=",
                      "eval.interval=0", "wandb.mode=disabled", "checkpoint.save_final=false"],
                     nproc=4)
    stages = " | ".join(f"stage {p}: layers {s['layers'][0]}-{s['layers'][1] - 1} dp {s['dp']} "
                        f"x tp {s['tp']}" for p, s in enumerate(plan.stages))
    assert f"pipeline: {stages}" in proc.stdout
    recs = [yaml.safe_load(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines() if ln]
    losses = [r["loss"] for r in recs if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
