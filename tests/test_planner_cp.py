"""The planner under context parallelism (issue 43): the memory and time rows at cp
(oases/planner/cp_cost.py: activations / cp, the ring's bytes and what hides), the
layout search choosing cp for a long sequence and not for a short one, and the plan it
writes: cp recorded, run with parallel.cp, refused at another cp. Cost model only: no
process group."""

from __future__ import annotations

import pytest
import torch
import yaml

from oases.config import load_config
from oases.errors import ConfigError, UserError
from oases.planner import report as rep
from oases.planner import stages as st
from oases.planner.cluster import Cluster
from oases.planner.comm_memory import CommLayout, communicators
from oases.planner.cost import ModelShape
from oases.planner.cp_cost import ACC_BYTES, Ring, core_share, ring_of
from oases.planner.fit import analytic_profile
from oases.planner.online import resolve_layout, resolve_plan
from oases.planner.plan_file import Plan, check_cp, check_run, load_plan
from oases.planner.search import search

QUIET = dict(log=lambda s: None)
# GQA (8 query heads, 4 kv heads), no tied head: the shapes the ring's kv blocks take
SHAPE = dict(n_layer=4, d_model=512, n_head=8, n_kv_heads=4, ffn_hidden=1024,
             vocab_size=1000, tie_embeddings=False, bias=False)
ONE_NODE = Cluster("one", 1, 4, 80.0, 1000.0, 100.0)
PAIRS = Cluster("pairs", 2, 2, 80.0, 400.0, 20.0, latency_ms=0.01)


def _flash(shape: ModelShape, base, tp: int = 4):
    """The analytic profile less its T^2 attention scores: what a GPU's flash kernels
    keep for backward (linear in the tokens), so the memory rows are the activations'."""
    prof = analytic_profile(shape, base, shape.valid_degrees(tp), 100e12)
    for t, e in prof.blocks["attn"].items():
        rows = base.micro_batch_size / base.sub_batches * int(t) / base.tp
        e["saved"] -= rows * shape.n_head / int(t) * shape.seq_len ** 2 * 4
    return prof


def _job(seq: int, batch: int, recompute: str = "fine", schedule: str = "oases",
         cp: bool = True) -> st.Job:
    return st.Job(ModelShape("llama", seq_len=seq, **SHAPE), batch, 2, schedule, recompute,
                  act_bytes=2, cp_search=cp)


def _build(job, cluster, pp, dp, cp, tp, c, rows, limit=None):
    base = st.profile_run(job, 4, 2)
    ch = st.Choice(pp, dp, tp, c, rows, (tp,), cp)
    return st.build(job, ch, cluster, _flash(job.shape, base), base, limit)


@pytest.mark.parametrize("recompute", ["none", "fine", "full"])
def test_memory_row_shrinks_with_cp(recompute):
    """The same rows per replica on cp = 2 ranks: each rank keeps half the activations
    (and half the rebuilt graph and logits), the same parameters, and computes about half
    (plus the ring)."""
    job = _job(8192, 4, recompute)
    one = _build(job, ONE_NODE, 1, 1, 1, 2, 1, 4)
    two = _build(job, ONE_NODE, 1, 1, 2, 2, 1, 4)
    for l in range(4):
        assert two.inst.a[0][l][0] == pytest.approx(one.inst.a[0][l][0] / 2, rel=1e-12)
        assert two.inst.m[0][l][0] == pytest.approx(one.inst.m[0][l][0], rel=1e-12)
        assert one.inst.a[0][l][0] > 0
    # embedding, final norm and head (Adam's 16 B a parameter, tp 2) and the head's bf16 copy
    head = job.shape.vocab_size * 512
    params = 16 * (job.shape.embed_params() + head + 512) / 2 + 2 * head / 2
    assert two.memory_const[0] - params == pytest.approx((one.memory_const[0] - params) / 2)
    # compute halves; the ring adds what its attention does not hide
    ring = [sum(two.models[0].ring["attn", 2]), sum(one.models[0].ring["attn", 2])]
    assert ring[0] > 0 and ring[1] == 0.0
    assert one.inst.t[0][1][0] / 2 < two.inst.t[0][1][0] < one.inst.t[0][1][0]


def test_ring_bytes_links_and_exposure():
    """K = 2 B Hkv (T/cp) D in the compute dtype, A the same in fp32; forward (cp-1) K,
    backward (cp-1) K + cp A; a cp group is consecutive DP ranks: inside a node at tp 1,
    across the nodes at tp 2 (ranks {0, 2}); each step's transfer hides behind that
    step's attention: both sub-batches' under oases (its ring steps are yield points),
    its own under megatron."""
    job = _job(8192, 4, "none")
    for tp, gbps in ((1, 400.0), (2, 20.0)):
        prob = _build(job, PAIRS, 1, 2 // tp, 2, tp, 1, 4)
        cm = prob.models[0]
        ring = ring_of(cm, tp)
        hkv = 4 // tp  # kv heads per rank
        K = 2 * (4 / 2) * hkv * (8192 / 2) * (512 // 8) * 2  # rows per sub-batch: 4 / 2
        assert ring.kv_bytes == K and ring.acc_bytes == K / 2 * ACC_BYTES
        assert ring.sent() == (K, K + 2 * ring.acc_bytes)
        lat = 1e-5 if tp == 2 else 0.0  # latency only between nodes
        assert ring.kv_s == pytest.approx(lat + K / (gbps * 1e9 / 8), rel=1e-12)
        prof = cm.profile.blocks["attn"][str(tp)]
        # under oases both sub-batches' steps run while one waits (yield points)
        step = 2 * core_share(job.shape) / 2
        rf, rb = ring.exposed(step * prof["fwd"], step * prof["bwd"])
        assert cm.ring["attn", tp] == (rf, rb) and cm.ring["mlp", tp] == (0.0, 0.0)
        assert cm.cf["attn", tp] == pytest.approx(prof["fwd"] + rf)
        assert cm.cb["attn", tp] == pytest.approx(prof["bwd"] + rb)
        if tp == 1:  # a fast link: the kv block hides, the last accumulator hop is waited
            assert rf == 0.0 and rb == pytest.approx(ring.acc_s)
        else:        # across 20 Gbit/s it does not
            assert rf == pytest.approx(ring.kv_s - step * prof["fwd"]) and rf > 0
        # megatron's ring hides behind its own step only: more of it is exposed
        meg = _build(_job(8192, 4, "none", "megatron"), PAIRS, 1, 2 // tp, 2, tp, 1, 4)
        alone = ring_of(meg.models[0], tp).exposed(step / 2 * prof["fwd"], step / 2 * prof["bwd"])
        assert meg.models[0].ring["attn", tp] == pytest.approx(alone)
        if tp == 2:
            assert alone[0] > rf and alone[1] > rb
    # recompute (fine) runs the forward ring again in backward
    fine = _build(_job(8192, 4, "fine"), PAIRS, 1, 1, 2, 2, 1, 4).models[0]
    rf, rb = fine.ring["attn", 2]
    prof = fine.profile.blocks["attn"]["2"]
    assert fine.cb["attn", 2] == pytest.approx(prof["bwd"] + rb + prof["fwd"] + rf)


def test_ring_exposure_per_step():
    """max(0, transfer - attention) per step: forward cp - 1 kv blocks; backward the
    first kv block, cp - 2 steps with a kv block and an accumulator, the last
    accumulator behind the last step, and the hop home waited whole; each exchange's
    call cost on top."""
    ring = Ring(4, 1e6, 2e6, kv_s=1.0, acc_s=2.0, call_s=0.0)
    assert ring.exposed(0.5, 1.0) == (3 * 0.5, 0.0 + 2 * 2.0 + 1.0 + 2.0)
    assert ring.exposed(10.0, 10.0) == (0.0, 2.0)  # all but the hop home hides
    calls = Ring(4, 1e6, 2e6, kv_s=1.0, acc_s=2.0, call_s=0.1)
    assert calls.exposed(10.0, 10.0) == pytest.approx((3 * 0.1, 2.0 + 7 * 0.1))
    assert ring.sent() == (3e6, 3e6 + 8e6)


def test_long_sequence_picks_cp_short_keeps_one():
    """64k tokens, 2 sequences per step on 4 devices: one sequence per sub-batch at
    tp 4 (the leanest cp-1 layout) needs about 4.2 GiB per device, so under 3 GiB no
    cp-1 layout fits and the search splits the sequences. 512 tokens with memory to
    spare: cp layouts are priced (the ring's bytes barely hide) and lose."""
    job = _job(65536, 2)
    base = st.profile_run(job, 4, 2)
    prof = _flash(job.shape, base)
    limit = 3 * 2**30
    with pytest.raises(ConfigError, match="no layout found that fits"):
        search(_job(65536, 2, cp=False), 4, ONE_NODE, prof, base, memory_limit=limit, **QUIET)
    res = search(job, 4, ONE_NODE, prof, base, memory_limit=limit, **QUIET)
    assert res.best.choice.cp > 1 and max(res.best.memory) <= limit
    assert all(c.choice.cp > 1 for c in res.ranked)
    assert "cp" in res.best.describe()

    job = _job(512, 8)
    base = st.profile_run(job, 4, 2)
    res = search(job, 4, ONE_NODE, _flash(job.shape, base), base, **QUIET)
    assert res.best.choice.cp == 1
    split = [c for c in res.ranked if c.choice.cp > 1]
    assert split and min(c.time for c in split) > res.best.time


def test_cp_only_where_it_runs():
    """cp > 1 choices: powers of two whose 2 cp chunks split the sequence evenly into at
    least MIN_CHUNK (128) tokens, every layer at tp, never with sequence parallelism, and
    only where the replica's rows do not split into cp x its sub-batches (cp x the
    replicas would run the same tokens per rank without the ring); the config decides
    whether to search them at all."""
    for seq, cps in ((1100, {1, 2}),   # 1100 % 8: no cp 4
                     (768, {1, 2}),    # cp 4: chunks of 96 tokens
                     (2048, {1, 2, 4, 8}), (64, {1})):
        got = st.enumerate_choices(_job(seq, 2), 8)
        assert {ch.cp for ch in got} == cps, seq
        assert all(ch.degrees == (ch.tp,) and ch.rows % (ch.cp * 2) for ch in got
                   if ch.cp > 1)
    # 8 sequences: a replica's 4 rows split over cp 2 x 2 sub-batches; 2 rows do not
    rows = {(ch.cp, ch.rows) for ch in st.enumerate_choices(_job(2048, 8), 8) if ch.cp > 1}
    assert (2, 2) in rows and (2, 4) not in rows
    job = _job(2048, 8)
    sp = st.Job(job.shape, 8, 2, "oases", "fine", sequence_parallel=True, cp_search=True)
    assert {ch.cp for ch in st.enumerate_choices(sp, 8)} == {1}
    # what cp does not take (oases.config.layout_checks.cp_needs) keeps the search at cp 1
    base = ["model.name=llama-tiny", "train.grad_accum=2"]
    assert st.job_from_config(load_config(None, base).validate(4)).cp_search
    window = load_config(None, base + ["model.arch=mistral", "model.sliding_window=8"])
    assert not st.job_from_config(window.validate(4)).cp_search


def _config(tmp_path, *extra):
    return load_config(None, ["model.name=llama-tiny", "model.seq_len=65536",
                              "parallel.tp=4", "train.micro_batch_size=2",
                              "train.grad_accum=1", f"out_dir={tmp_path}", *extra]).validate(4)


def test_plan_with_cp_round_trips_and_is_refused_at_another_cp(tmp_path):
    """The search's pick at cp > 1 becomes a plan file recording cp; plan=auto's run of it
    sets parallel.cp (and its run line says so); the runtime accepts it at that cp and
    refuses it, with one line naming parallel.cp, at another."""
    from oases.planner.auto_layout import pointed_at

    cfg = _config(tmp_path)
    job = st.job_from_config(cfg)
    assert job.cp_search and job.global_batch == 2
    base = st.profile_run(job, 4, 2)
    res = search(job, 4, ONE_NODE, _flash(job.shape, base), base,
                 memory_limit=0.6 * 2**30, **QUIET)
    best = res.best
    assert best.choice.cp > 1
    path = tmp_path / "plan.yaml"
    rep.to_plan(best, res, cfg, ONE_NODE.name).save(path)
    plan = load_plan(str(path))
    assert plan.cp == best.choice.cp and plan.micro_batches == best.choice.micro_batches
    assert f"parallel.cp={plan.cp}" in plan.predicted["run"].split()
    run = pointed_at(cfg, path, 4)
    assert run.parallel.cp == plan.cp and run.parallel.plan == str(path)
    assert run.dp * run.parallel.cp * run.parallel.tp == 4 and run.global_batch_size == 2
    assert resolve_plan(run, None) == (run, None)  # every block at tp: no degrees
    other = run.with_changes({"parallel.cp": 1})
    with pytest.raises(UserError, match=rf"^plan file {path} was made for .*parallel.cp="
                                        rf"{plan.cp} .*; this run has parallel.cp=1$"):
        resolve_plan(other, None)
    # a pipelined plan at cp: its stages' dp counts the cp ranks, the layout takes them
    stages = [{"layers": [0, 2], "dp": 2, "tp": 1}, {"layers": [2, 4], "dp": 2, "tp": 1}]
    path.write_text(yaml.safe_dump({"tp": 1, "pp": 2, "cp": 2, "micro_batch_size": 1,
                                    "micro_batches": 2, "stages": stages}))
    piped = pointed_at(cfg, path, 4)
    assert (piped.parallel.pp, piped.parallel.cp, piped.dp) == (2, 2, 1)
    assert [(s.dp, s.tp) for s in resolve_layout(piped, 4).stages] == [(2, 1), (2, 1)]


def test_what_a_cp_run_refuses(tmp_path):
    """Under cp only what the search writes for it runs: per-block degrees, uneven stages
    and sequence parallelism are refused with one line; the config takes a plan file and
    plan=auto's layout search at cp, not plan=auto's per-block degrees."""
    cfg = _config(tmp_path, "parallel.cp=2", "parallel.tp=2")
    for plan, why in [(Plan([2, 1] * 4, 2, {}), r"per-block TP degrees \(degrees \[1, 2\]"),
                      (Plan([], 2, {}, stages=[{"layers": [0, 1], "dp": 1, "tp": 2},
                                               {"layers": [1, 4], "dp": 1, "tp": 2}]),
                       r"the even split at one tp, \[\(\[0, 2\], 2\), \(\[2, 4\], 2\)\]"),
                      (Plan([2] * 8, 2, {}, sequence_parallel=True), "sequence_parallel")]:
        with pytest.raises(UserError, match=rf"^parallel.cp=2 with p.yaml: .*{why}"):
            check_cp(plan, cfg, "p.yaml")
    check_cp(Plan([2] * 8, 2, {}), cfg, "p.yaml")
    check_run(Plan([2] * 8, 2, {}), cfg)  # hand-written (no micro_batches): not checked
    ok = ["parallel.cp=2", "parallel.tp=2"]
    for extra in (["parallel.plan=p.yaml"], ["parallel.plan=auto", "parallel.plan_search=amp"]):
        _config(tmp_path, *ok, *extra)
    with pytest.raises(ConfigError, match="plan_search=tp-only: per-block TP degrees"):
        _config(tmp_path, *ok, "parallel.plan=auto")
    from oases.planner.api import make_plan
    with pytest.raises(ConfigError, match="do not run under parallel.cp=2"):
        make_plan(cfg, ONE_NODE, None, None)


def test_cp_rings_hold_communicators():
    """dp 2 x cp 2 x tp 2: the world, TP, DP (over dp x cp) and the cp ring's own
    point-to-point communicator."""
    assert communicators(CommLayout(((4, 2),), (False,), cp=2)) == [4] * 8
    assert communicators(CommLayout(((4, 2),), (False,))) == [3] * 8


def test_cli_writes_a_cp_plan(tmp_path, capsys):
    """python -m oases.plan on a long sequence under a tight memory limit: the plan and
    its run line have cp > 1 (a fabricated profile DB: no profiling)."""
    from oases.cli.plan import main
    from oases.planner.profile import profile_key, save_db

    overrides = ["model.name=llama-tiny", "model.seq_len=65536", "parallel.tp=4",
                 "train.micro_batch_size=2", "train.grad_accum=1"]
    cfg = load_config("configs/llama-tiny.yaml", overrides).validate(4)
    job = st.job_from_config(cfg)
    base = st.profile_run(job, 4, cfg.train.micro_batch_size)
    prof = _flash(job.shape, base)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    save_db(tmp_path / "db.json", {profile_key(device, job.shape, base, "fp32"):
                                   {"blocks": prof.blocks, "constant": prof.constant}})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(
        {"name": "one", "nodes": 1, "devices_per_node": 4, "device_memory_gib": 80,
         "intra_node_bandwidth_gbps": 1000.0, "inter_node_bandwidth_gbps": 100.0}))
    rc = main(["--config", "configs/llama-tiny.yaml", "--cluster", str(tmp_path / "c.yaml"),
               "--profile", str(tmp_path / "db.json"), "--out", str(tmp_path / "plan.yaml"),
               "--memory-gib", "0.6", *overrides])
    out = capsys.readouterr()
    assert rc == 0, out.err
    plan = load_plan(str(tmp_path / "plan.yaml"))
    assert plan.cp > 1 and f"parallel.cp={plan.cp}" in out.out.split("run it: ")[1].split()
    assert f"x cp {plan.cp} x tp {plan.tp}" in out.out
