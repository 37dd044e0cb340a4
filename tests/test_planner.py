"""Planner: ILP exactness and speed, memory infeasibility, plan files, mixed-degree
runtime parity with tp=1 under both schedules, and the CLI."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from oases.models import build_model
from oases.config import load_config
from oases.dp.reducer import GradReducer
from oases.errors import UserError
from oases.overlap.engines import build_engine
from oases.parallel.reshard import grad_group_of
from oases.parallel.sharding import unshard
from oases.planner import ilp
from oases.planner.cluster import Cluster, load_cluster
from oases.planner.cost import CostModel, ModelShape, Profile, RunShape
from oases.planner.fit import analytic_profile, calibrate_host_cost
from oases.planner.plan_file import Plan, check_plan, load_plan
from tests.support.distributed import run_distributed
from tests.support.forked_runs import single_forked

ROOT = Path(__file__).resolve().parents[1]


def _random_profile(shape, run, degrees, rng) -> Profile:
    """Costs that make every degree plausible somewhere (forces real trade-offs)."""
    blocks = {k: {str(t): {"fwd": rng.uniform(1e-3, 2e-2), "bwd": rng.uniform(2e-3, 4e-2),
                           "saved": rng.uniform(1e6, 4e7)} for t in degrees}
              for k in ("attn", "mlp")}
    return Profile(blocks, {"fwd": 1e-3, "bwd": 2e-3, "step": 1e-3, "peak": 1e6})


@pytest.mark.parametrize("schedule,recompute", [("oases", "fine"), ("oases", "full"),
                                                ("oases", "none"), ("megatron", "none")])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ilp_equals_brute_force(schedule, recompute, seed):
    rng = random.Random(seed)
    shape = ModelShape("gpt", 3, 256, 8, 8, 1024, 512, 64)
    run = RunShape(4, 1, 8, 1, 2, schedule, recompute)
    cluster = load_cluster(str(ROOT / "configs/cluster/hetero-4.yaml"))
    cm = CostModel(shape, run, cluster, _random_profile(shape, run, [1, 2, 4], rng))
    free = ilp.brute_force(cm)
    sol = ilp.solve(cm)
    assert sol.time_s == pytest.approx(free.time_s, rel=1e-9)
    # a memory limit between the smallest and the unconstrained optimum's memory
    lo = ilp.min_memory(cm)
    limit = lo + 0.5 * (free.memory_bytes - lo) if free.memory_bytes > lo else lo * 1.001
    want = ilp.brute_force(cm, limit)
    got = ilp.solve(cm, limit)
    assert got.memory_bytes <= limit
    assert got.time_s == pytest.approx(want.time_s, rel=1e-9)


def test_cost_model_grad_sync_hiding_and_host_comm_cost():
    """Replica gradient syncs queue on the link and hide behind the backward left
    after their block (none for block 0); measured host cycles per byte add to every
    overlapped collective; and the ILP stays exact with both terms on."""
    shape = ModelShape("gpt", 2, 256, 8, 8, 1024, 512, 64)
    run = RunShape(2, 1, 8, 1, 2, "oases", "fine")
    cluster = Cluster("c", 2, 1, 4, 100, 0.5)
    prof = analytic_profile(shape, run, [1, 2], flops_per_s=1e9)  # slow compute: lots to hide
    cm = CostModel(shape, run, cluster, prof)
    s_attn, s_mlp = cm.sync["attn", 1], cm.sync["mlp", 1]
    assert s_attn > 0 and cm.sync["attn", 2] == 0
    assert cm.sync_exposed([1, 2, 2, 2]) == pytest.approx(s_attn)      # nothing after block 0
    assert cm.hide([2, 2, 1, 2], 2) > s_attn
    assert cm.sync_exposed([2, 2, 1, 2]) == 0.0                       # fully hidden
    # below a degree-2 block both sub-batches still run it; a degree-1 block (no
    # collective to take turns at) is left to the second sub-batch only
    assert cm.free["attn", 2] == pytest.approx(2 * cm.cb["attn", 2])
    assert cm.free["attn", 1] == pytest.approx(cm.cb["attn", 1])
    # syncs queue: two of them need the sum of their times beyond the free link time
    p = [2, 2, 1, 1]
    want = max(0.0, s_attn - cm.hide(p, 2), s_attn + s_mlp - cm.hide(p, 3))
    assert cm.hide(p, 3) == pytest.approx(cm.hide(p, 2) + cm.cb["attn", 1])
    assert cm.sync_exposed(p) == pytest.approx(want)
    base = cm.plan_time([2, 1, 2, 2])
    loaded = Profile(prof.blocks, prof.constant, {"cpu_per_byte": {"2": 1e-9}})
    cm2 = CostModel(shape, run, cluster, loaded)
    # 2 all-reduces (fwd, bwd) x 2 sub-batches of a block's activation at degree 2
    act = cm.rows(2) * shape.seq_len * shape.d_model * 4
    assert cm2.node_cost(1, 2) - cm.node_cost(1, 2) == pytest.approx(4 * act * 1e-9)
    assert cm2.plan_time([2, 1, 2, 2]) > base
    for c in (cm, cm2):
        assert ilp.solve(c).time_s == pytest.approx(ilp.brute_force(c).time_s, rel=1e-9)


def test_calibration_fits_the_host_cost_to_a_measured_step():
    """One real step time fixes the scale of the host cost of communication (the
    prediction is linear in it); the scale is clamped at 0 and at its maximum, and a
    profile without a host cost (GPUs) comes back unchanged."""
    shape = ModelShape("gpt", 2, 256, 8, 8, 1024, 512, 64)
    run = RunShape(2, 1, 8, 1, 2, "oases", "fine")
    cluster = Cluster("c", 2, 1, 4, 100, 0.5)
    base = analytic_profile(shape, run, [1, 2], flops_per_s=1e9)
    prof = Profile(base.blocks, base.constant, {"cpu_per_byte": {"2": 1e-9}})
    ref = [2, 2, 2, 2]

    def predicted(p):
        return CostModel(shape, run, cluster, p).plan_time(ref)

    want = Profile(base.blocks, base.constant, {"cpu_per_byte": {"2": 3e-9}})
    got, scale, before, after = calibrate_host_cost(shape, run, cluster, prof, ref,
                                                    predicted(want))
    assert scale == pytest.approx(3.0) and before == pytest.approx(predicted(prof))
    assert after == pytest.approx(predicted(want))
    assert got.comm["cpu_per_byte"]["2"] == pytest.approx(3e-9)
    assert predicted(got) == pytest.approx(predicted(want))
    # gradient syncs (none in the calibration step) keep the profiled cost
    cm = CostModel(shape, run, cluster, got)
    assert cm.cpu_per_byte(2) == pytest.approx(3e-9) and cm.sync_cpu_per_byte() == pytest.approx(1e-9)
    mixed = [2, 1, 2, 2]
    plain = CostModel(shape, run, cluster, want).plan_time(mixed)
    sync_bytes = shape.block_params("mlp") * 4
    assert cm.plan_time(mixed) == pytest.approx(plain - sync_bytes * 2e-9)
    _, scale, _, _ = calibrate_host_cost(shape, run, cluster, prof, ref, 1e-6)  # faster than compute
    assert scale == 0.0
    _, scale, _, _ = calibrate_host_cost(shape, run, cluster, prof, ref, 1e6, max_scale=50.0)
    assert scale == 50.0
    same, scale, _, _ = calibrate_host_cost(shape, run, cluster, base, ref, 1e6)
    assert same is base and scale == 1.0


def test_ilp_solves_96_blocks_by_4_degrees_fast():
    shape = ModelShape("gpt", 48, 2048, 16, 16, 8192, 50257, 2048)
    run = RunShape(8, 1, 8, 1, 2, "oases", "fine")
    cluster = Cluster("box", 1, 8, 80, 200, 25)
    cm = CostModel(shape, run, cluster, analytic_profile(shape, run, [1, 2, 4, 8]))
    t0 = time.perf_counter()
    sol = ilp.solve(cm, 80 * 2**30)
    elapsed = time.perf_counter() - t0
    assert len(sol.degrees) == 96 and len(cm.degrees) == 4
    # the target is < 1 s on 2 cores; leave headroom for a loaded CI machine
    assert elapsed < 5.0, elapsed


def test_infeasible_memory_names_the_minimum():
    shape = ModelShape("gpt", 2, 256, 8, 8, 1024, 512, 64)
    run = RunShape(4, 1, 8, 1, 2, "oases", "fine")
    cm = CostModel(shape, run, Cluster("c", 4, 1, 1, 100, 1), analytic_profile(shape, run, [1, 2, 4]))
    need = ilp.min_memory(cm)
    with pytest.raises(UserError, match=r"smallest plan needs [0-9.]+ GiB"):
        ilp.solve(cm, need * 0.5)
    assert ilp.solve(cm, need * 1.0001).memory_bytes <= need * 1.0001


def test_memory_limit_makes_mixed_plan_win():
    """When low uniform degrees don't fit, the ILP mixes degrees and beats every
    uniform plan that fits (the cost model's view)."""
    shape = ModelShape("gpt", 4, 1024, 16, 16, 4096, 512, 256)
    run = RunShape(4, 1, 8, 32, 2, "oases", "fine")
    cluster = Cluster("slow", 4, 1, 1, 100, 0.2)  # slow links favour low degrees
    cm = CostModel(shape, run, cluster, analytic_profile(shape, run, [1, 2, 4], 20e9))
    mem = {t: cm.plan_memory([t] * cm.n) for t in cm.degrees}
    assert mem[1] > mem[2] > mem[4]
    limit = (mem[2] + mem[4]) / 2            # degree 1 and 2 do not fit uniformly
    sol = ilp.solve(cm, limit)
    uni = ilp.best_uniform(cm, limit)
    assert uni.degrees[0] == 4
    assert len(set(sol.degrees)) > 1 and sol.time_s < uni.time_s


def _gpt_tiny_t2():
    return load_config(None, ["model.name=gpt-tiny", "model.seq_len=64", "model.dropout=0",
                              "parallel.tp=2", "parallel.schedule=megatron",
                              "parallel.recompute=none", "train.micro_batch_size=4",
                              "train.grad_accum=4", "data.kind=synthetic"]).validate(2)


class _ActivationMeter:
    """SavedTensorMeter without the parameters autograd saves (they are counted once,
    with the gradients and Adam moments, as the cost model's 16 B per parameter)."""

    def __new__(cls, model):
        from oases.overlap.memory import SavedTensorMeter

        params = {p.untyped_storage().data_ptr() for p in model.parameters()}

        class Meter(SavedTensorMeter):
            def _add(self, t):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in params:
                    return
                super()._add(t)

        return Meter()


def _measure_memory_body(ctx, plans: dict, out: str) -> None:
    """Per plan, the most any rank holds: parameter, gradient and Adam bytes (the tensors
    themselves) plus the peak of the saved activations over a real train_step."""
    from oases.runtime.data import TrainBatches
    from oases.runtime.optim import build_optimizer
    from oases.runtime.step import TrainState, train_step
    cfg = _gpt_tiny_t2()
    got = {}
    for name, degrees in plans.items():
        mixed = set(degrees) != {ctx.tp}
        model = build_model(cfg.model, cfg.padded_vocab_size, ctx.tp_group, seed=0,
                            degrees=degrees if mixed else None,
                            degree_groups=ctx.degree_groups() if mixed else None)
        opt = build_optimizer(model, cfg.train, ctx.device)
        red = GradReducer(model, ctx.dp_group, group_of=grad_group_of(ctx, ctx.tp))
        batches = TrainBatches(cfg.data, cfg.model.seq_len, cfg.model.vocab_size,
                               cfg.train.micro_batch_size, 0, 1, cfg.seed)
        with _ActivationMeter(model) as meter:
            train_step(TrainState(cfg, ctx, model, opt, red), batches, 1e-3)
        held = sum(t.numel() * t.element_size() for p in model.parameters()
                   for t in (p, p.grad, *opt.state[p].values()) if t.dim() > 0)
        v = torch.tensor([float(held + meter.peak_bytes)], dtype=torch.float64)
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        got[name] = float(v)
    if ctx.rank == 0:
        torch.save(got, out)


def test_memory_limit_makes_mixed_plan_win_measured(tmp_path):
    """The same claim on a model small enough to run (gpt-tiny at T=2, world 2, gloo):
    the profiler measures each block's saved activations (as ``plan=auto`` does); the
    step times are the FLOP model's on a slow link (so degree 1 is faster, and a
    memory limit between the uniform plans makes the ILP mix degrees: a real step
    time on this shared CPU host could not rank plans 10% apart). Then the chosen
    mixed plan and both uniform plans run a real ``train_step``, each rank measuring
    what it holds: its parameters, gradients and Adam moments (the tensors' bytes)
    plus the peak of the saved activations (``SavedTensorMeter``).

    Memory is counted, not timed, so it is exact and deterministic. The cost model
    predicts every plan's memory relative to uniform degree T (the embedding, head and
    loss are the same in every plan) to within ``allow``: it divides each block's
    parameters by its degree, whereas the norms and the row-parallel bias (3 d per
    block) are replicated, which at most 16 B x 3 d per block can be off (measured:
    24 KiB over 8 blocks for uniform degree 1, against 48 KiB allowed and a 6.5 MiB
    span between the uniform plans). Measured the same way, the mixed plan fits the
    limit and uniform degree 1 exceeds it by half the span. A memory model that
    ignores the limit, drops the saved activations or the 1/t of the parameters, or
    a runtime that keeps more alive than the model says (a batch slice kept as a view
    of the whole activation: 64 KiB) fails here."""
    from oases.planner.profile import profile_compute

    cfg = _gpt_tiny_t2()
    shape = ModelShape.from_config(cfg.model)
    run = RunShape(2, 1, 4, 4, 1, "megatron", "none")
    measured = profile_compute(cfg, run, torch.device("cpu"), reps=1, warmup=1,
                               log=lambda s: None)
    prof = analytic_profile(shape, run, [1, 2], 20e9)
    for kind, per_degree in prof.blocks.items():
        for t, entry in per_degree.items():
            entry["saved"] = measured.blocks[kind][t]["saved"]
    cm = CostModel(shape, run, Cluster("slow", 2, 1, 1, 100, 0.2), prof)
    mem = {t: cm.plan_memory([t] * cm.n) for t in cm.degrees}
    limit = (mem[1] + mem[2]) / 2            # uniform degree 1 does not fit
    sol, uni = ilp.solve(cm, limit), ilp.best_uniform(cm, limit)
    assert ilp.solve(cm).degrees == [1] * cm.n  # without the limit degree 1 is fastest
    assert uni.degrees == [2] * cm.n

    plans = {"uniform 2": [2] * cm.n, "uniform 1": [1] * cm.n, "mixed": sol.degrees}
    out = tmp_path / "mem.pt"
    run_distributed(_measure_memory_body, world=2, tp=2, args=(plans, str(out)))
    got = torch.load(out)
    base = "uniform 2"
    allow = 16 * 3 * cfg.model.d_model * cm.n
    for name, degrees in plans.items():
        pred = cm.plan_memory(degrees) - cm.plan_memory(plans[base])
        real = got[name] - got[base]
        assert abs(real - pred) <= allow, (name, degrees, real, pred)
    real_limit = limit - cm.plan_memory(plans[base]) + got[base]  # the limit in measured bytes
    assert got["mixed"] <= real_limit < got["uniform 1"], (sol.degrees, got, real_limit)
    assert got["uniform 1"] - real_limit > 0.4 * (got["uniform 1"] - got[base])
    # and the plan that fits is a mix, faster than the only uniform plan that fits
    assert len(set(sol.degrees)) > 1 and sol.time_s < uni.time_s


def test_plan_file_checks(tmp_path):
    cfg = load_config(None, ["model.name=gpt-tiny", "parallel.tp=4"]).validate(4)
    p = tmp_path / "plan.yaml"
    Plan([4, 4, 2, 2, 1, 1, 2, 4], 4, {"arch": "gpt", "n_layer": 4}).save(p)
    assert check_plan(load_plan(str(p)), cfg.model, 4) == [4, 4, 2, 2, 1, 1, 2, 4]
    bad = [([4, 4], "has 2 degrees"), ([3] * 8, "not a power of two"),
           ([8] * 8, "not a power of two dividing")]
    for degrees, msg in bad:
        Plan(degrees, 4, {}).save(p)
        with pytest.raises(UserError, match=msg):
            check_plan(load_plan(str(p)), cfg.model, 4)
    Plan([4] * 8, 4, {"d_model": 512}).save(p)
    with pytest.raises(UserError, match="another model.*d_model: plan 512 vs model 128"):
        check_plan(load_plan(str(p)), cfg.model, 4)
    cfg2 = load_config(None, ["model.name=llama-tiny", "parallel.tp=2"]).validate(2)
    Plan([2, 2, 1, 1, 2, 2, 1, 1], 2, {}).save(p)
    check_plan(load_plan(str(p)), cfg2.model, 2)
    p.write_text("degrees: [1, 2]\nfoo: 1\n")
    with pytest.raises(UserError, match="unknown keys: foo"):
        load_plan(str(p))


def _full_grads(model, ctx):
    dg = ctx.degree_groups()
    out = {}
    for n, p in model.named_parameters():
        g = p.grad.contiguous()
        t = p.tp_coords[1] if p.tp_spec is not None else 1
        if t > 1:
            gs = [torch.empty_like(g) for _ in range(t)]
            dist.all_gather(gs, g, group=dg.sub[t])
            g = unshard(gs, p.tp_spec)
        out[n] = g
    return out


def _mixed_body(ctx, degrees, name):
    cfg = load_config(None, [f"model.name={name}", f"parallel.tp={ctx.tp}", "model.n_layer=4"]
                      ).validate(ctx.world_size)
    ref_cfg = load_config(None, [f"model.name={name}", "model.n_layer=4"]).validate(1)
    g = torch.Generator().manual_seed(1)
    # each DP replica gets its own half of the global batch
    ids = torch.randint(0, 256, (8 * ctx.dp, 32), generator=g)
    y = torch.randint(0, 256, (8 * ctx.dp, 32), generator=g)
    mine = slice(8 * ctx.dp_rank, 8 * ctx.dp_rank + 8)
    ref = build_model(ref_cfg.model, ref_cfg.padded_vocab_size, None, seed=4)
    ref_loss = ref(ids, y)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for sched, rc in [("megatron", "none"), ("megatron", "full"), ("oases", "fine"),
                      ("oases", "full")]:
        dg = ctx.degree_groups()
        model = build_model(cfg.model, cfg.padded_vocab_size, ctx.tp_group, None,
                            rc if sched == "megatron" else "none", seed=4, degrees=degrees,
                            degree_groups=dg)
        red = GradReducer(model, ctx.dp_group, group_of=grad_group_of(ctx, ctx.tp))
        red.zero_grad()
        red.arm()
        loss = build_engine(sched, ctx.tp_group, 2, rc).forward_backward(model, ids[mine], y[mine])
        red.finish()
        mean = loss.clone()
        if ctx.dp > 1:
            dist.all_reduce(mean, group=ctx.dp_group)
            mean /= ctx.dp
        # fp32: the same sums in a different order (sharded matmuls, replica sums)
        torch.testing.assert_close(mean, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        grads = _full_grads(model, ctx)
        for k, v in grads.items():
            torch.testing.assert_close(v, ref_grads[k], rtol=1e-4, atol=2e-6, msg=f"{sched} {rc} {k}")


@pytest.mark.parametrize("world,tp,degrees,name", [
    (4, 4, [4, 4, 2, 2, 1, 1, 2, 4], "gpt-tiny"),
    (4, 4, [1, 2, 4, 1, 2, 1, 4, 4], "gpt-tiny"),
    (4, 2, [1, 2, 2, 1, 2, 1, 1, 2], "llama-tiny"),   # dp 2 x tp 2
])
def test_mixed_plan_matches_tp1(world, tp, degrees, name):
    run_distributed(_mixed_body, world=world, tp=tp, args=(degrees, name))


@pytest.mark.slow
def test_plan_cli_and_bad_plan_exit_2(tmp_path):
    out = tmp_path / "plan.yaml"
    r = subprocess.run([sys.executable, "-m", "oases.plan", "--config", "configs/gpt-tiny.yaml",
                        "--cluster", "configs/cluster/hetero-4.yaml", "--search", "tp-only",
                        "--profile", str(tmp_path / "db.json"), "--out", str(out), "parallel.tp=4",
                        "parallel.schedule=oases", "parallel.recompute=fine",
                        "model.n_layer=2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "best uniform plan" in r.stdout and "predicted step" in r.stdout
    plan = yaml.safe_load(out.read_text())
    assert len(plan["degrees"]) == 4 and all(d in (1, 2, 4) for d in plan["degrees"])
    assert plan["predicted"]["step_time_s"] > 0
    assert out.with_suffix(".png").stat().st_size > 1000
    assert (tmp_path / "db.json").exists()  # the profile DB, reused next time
    r2 = subprocess.run([sys.executable, "-m", "oases.plan", "--config", "configs/gpt-tiny.yaml",
                         "--cluster", "configs/cluster/hetero-4.yaml", "--search", "tp-only",
                         "--profile", str(tmp_path / "db.json"), "--out", str(tmp_path / "p2.yaml"),
                         "parallel.tp=4", "parallel.schedule=oases", "parallel.recompute=fine",
                         "model.n_layer=2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r2.returncode == 0 and "reusing" in r2.stdout
    # a plan for another model: one line, exit 2 (train.py's main on a forked rank)
    r3 = single_forked(["--config", "configs/gpt-tiny.yaml", f"out_dir={tmp_path / 'run'}",
                        "parallel.tp=1", f"parallel.plan={out}", "data.kind=synthetic",
                        "data.val_path=", "wandb.mode=disabled"], timeout=120)
    assert r3.returncode == 2
    lines = r3.stderr.strip().splitlines()
    # the plan was made for n_layer=2 at tp=4; this run is n_layer=4 at tp=1
    assert len(lines) == 1 and "another model" in lines[0] and "n_layer" in lines[0], r3.stderr
    assert "Traceback" not in r3.stderr


@pytest.mark.serial  # measures the host's CPU load: a test running beside it would count
def test_plan_auto_end_to_end(tmp_path, run_train):
    """``parallel.plan=auto`` on a live 2-process job: collectives and the host cost of
    communication measured, blocks profiled on both ranks (averaged), real steps at
    degree tp calibrate the model, solved on rank 0, degrees broadcast, plan and
    profile written, and the run trains."""
    out = tmp_path / "run"
    common = ["--config", "configs/gpt-tiny.yaml", "model.d_model=64", "model.n_layer=2",
              "model.n_head=4", "model.n_kv_heads=4", "model.ffn_hidden=128", "model.seq_len=32",
              "model.dropout=0.1",  # so that the random state matters
              "parallel.tp=2", "parallel.schedule=oases", "parallel.recompute=fine",
              "train.micro_batch_size=4", "train.grad_accum=2", "train.steps=2",
              "data.kind=synthetic",
              "data.val_path=", "eval.interval=0", "wandb.mode=disabled", "checkpoint.interval=0",
              "checkpoint.save_final=false"]
    proc = run_train(common + ["parallel.plan=auto", "parallel.plan_calibration_steps=1",
                               f"out_dir={out}"],
                     env={"HOME": str(tmp_path)})  # the profile DB goes to this HOME
    assert "plan=auto: wrote" in proc.stdout
    assert "plan=auto: calibration: measured" in proc.stdout
    # two micro-batches per step: both schedules predicted, the faster one run
    assert "plan=auto: overlap_fb " in proc.stdout
    plan = load_plan(out / "plan.yaml")
    assert isinstance(plan.predicted["overlap_fb"], bool)
    assert len(plan.degrees) == 4 and set(plan.degrees) <= {1, 2}
    prof = yaml.safe_load((out / "profile.json").read_text())
    cal = prof["calibration"]
    # measured, not defaulted: moving bytes through gloo's TCP transport costs the host
    # CPU time (the figure is clamped at 0, so ">= 0" would hold for a broken measurement);
    # the calibration may scale it (to 0 where the per-call cost explains the step)
    assert set(cal["cpu_per_byte_profiled"]) == {"2"} and cal["cpu_per_byte_profiled"]["2"] > 0
    assert set(prof["comm"]["cpu_per_byte"]) == {"2"}
    assert prof["comm"]["on"] == {"tp": 2, "dp": 1} and prof["comm"]["call_s"] >= 0
    assert set(prof["blocks"]["attn"]) == {"1", "2"}
    e = prof["blocks"]["attn"]["1"]  # two row counts: the affine fit's points
    assert e["rows2"] == 2 * e["rows"] and e["fwd2"] > 0 and e["bwd2"] > 0
    assert cal["degrees"] == [2, 2, 2, 2] and cal["measured_s"] > 0 and cal["steps"] == 1
    # the fit: inside its clamp range [0, 50] the calibrated model predicts the measured
    # step; at a bound it is the closest it can get, on the side the clamp leaves
    scale, measured, after = cal["host_cost_scale"], cal["measured_s"], cal["predicted_s"]
    if scale == 1.0 and after == cal["predicted_before_s"]:
        pass  # this tiny model's prediction does not depend on the host cost: nothing to fit
    elif 0.0 < scale < 50.0:
        assert after == pytest.approx(measured, rel=1e-6), cal
    elif scale == 0.0:
        assert after >= measured, cal
    else:
        assert scale == 50.0 and after <= measured, cal
    assert (tmp_path / ".cache" / "oases" / "profile_db.json").exists()
    recs = [yaml.safe_load(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln]
    assert max(r.get("step", 0) for r in recs) == 2
    # the calibration steps leave no trace in the run: the plan it chose, given as a
    # file, trains the same losses (paired or not: overlap_fb changes no number)
    again = tmp_path / "again"
    run_train(common + [f"parallel.plan={out / 'plan.yaml'}", f"out_dir={again}"],
              env={"HOME": str(tmp_path)})
    recs2 = [yaml.safe_load(ln) for ln in (again / "metrics.jsonl").read_text().splitlines() if ln]
    assert [r["loss"] for r in recs if "loss" in r] == [r["loss"] for r in recs2 if "loss" in r]
