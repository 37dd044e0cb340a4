"""ZeRO levels 1-3 against level 0 (replicated), through the real build and step
(tests/support/zero_levels.py).

Each configuration trains 3 optimizer steps of ``train_step`` from the same seed with
the objects ``build_train_state`` builds (reducer with sharded buckets, optimizer over the
owned segments, ZeRO-3 parameter store wired into the engine), on synthetic data,
and the per-step loss, gradient norm and final full parameters must equal level 0's.

Tolerance: fp32, the shipped AdamW eps (1e-8). Level 1 runs the same all-reduce and
the same elementwise AdamW on slices of the same numbers; levels 2 and 3 replace the
all-reduce by a reduce-scatter (at dp = 2 the same two-operand sums). What differs is
the gradient norm's summation order (float64 over owned pieces), which moves the
clipping factor by ~1e-7 relative. Losses and norms: ``rtol=1e-5``. Weights: entries
whose exact gradient is zero (the key bias: softmax ignores it) carry only rounding
noise, which Adam's m / (sqrt(v) + eps) scales up to lr-sized moves, so a change in
the last bits of the clipping factor shows up there (measured: 3 of 384 key-bias
entries differ by up to 1.1e-6 after 3 steps at lr 1e-3; everything else agrees to
~1e-8). ``atol=1e-5`` is 1% of one step. A real bug is far outside: a wrong owned
range or a stale gathered block moves weights by whole steps (1e-3) and the loss
at the 1e-3 level; a reduce-scatter without the dp average doubles the norm.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from oases.runtime.optim import lr_at
from oases.runtime.step import train_step
from tests.support.distributed import run_distributed
from tests.support.zero_levels import (PARAM_ATOL, STEPS, build_rank, run_levels,
                                       zero_config)


def _body(ctx, schedule, recompute):
    res = run_levels(ctx, (0, 1, 2, 3), schedule, recompute)
    ref_l, ref_n, ref_p, _ = res[0]
    for zero in (1, 2, 3):
        losses, norms, params, store = res[zero]
        assert_close(torch.tensor(losses), torch.tensor(ref_l), rtol=1e-5, atol=0,
                     msg=f"zero={zero} losses")
        assert_close(torch.tensor(norms), torch.tensor(ref_n), rtol=1e-5, atol=0,
                     msg=f"zero={zero} norms")
        for name, p in params.items():
            assert_close(p, ref_p[name], rtol=0, atol=PARAM_ATOL,
                         msg=lambda m, n=name: f"zero={zero} {n}: {m}")
    gathers, late = res[3][3]
    assert gathers > 0
    if schedule == "oases":  # every block but the first of each pass was prefetched
        assert late < gathers / 2, (gathers, late)


# the fast tier keeps dp 2 x tp 2 under oases+fine; make test runs all four
@pytest.mark.parametrize("world,tp,schedule,recompute", [
    pytest.param(w, tp, s, r, marks=() if (w, s) == (4, "oases") else pytest.mark.slow)
    for w, tp in ((2, 1), (4, 2)) for s, r in (("megatron", "none"), ("oases", "fine"))])
def test_zero_levels_match_replicated(world, tp, schedule, recompute):
    run_distributed(_body, world=world, tp=tp, args=(schedule, recompute))


def _memory_body(ctx, out):
    """Bytes held between steps at each level, dp = 4, with fp32 weights and with bf16
    weights over fp32 masters."""
    for prec in ("fp32", "bf16"):
        for zero in (0, 1, 2, 3):
            cfg = zero_config(ctx.world_size, 1, zero, "megatron", "none",
                              ("train.grad_accum=1", "parallel.dp_bucket_mb=25",
                               f"train.precision={prec}"))
            ts, model, engine, opt, reducer, pipe, batches = build_rank(cfg, ctx)
            train_step(ts, batches, 1e-3)
            if ctx.rank == 0:
                key = zero if prec == "fp32" else f"bf16-{zero}"
                out[key] = reducer.memory(model, opt)
                out[f"n{zero}"] = sum(p.numel() for p in model.parameters())


def _memory_worker(ctx, path):
    out = {}
    _memory_body(ctx, out)
    if ctx.rank == 0:
        torch.save(out, path)


def test_zero_memory_ratios(tmp_path):
    """Measured storages at dp = 4: level 1 divides the Adam state by 4, level 2 the
    gradients too, level 3 the parameters too (within 10%: the owned ranges are padded
    to a multiple of 4), and the planner's per-level memory model predicts each. With
    bf16 weights (``train.precision=bf16``) the parameters take half the bytes (none
    between steps at level 3), and the fp32 masters are whole at level 0 and divided by
    4 at levels 1-3, as the planner's ``master`` row says."""
    from oases.planner.zero_cost import zero_memory

    path = str(tmp_path / "mem.pt")
    run_distributed(_memory_worker, world=4, tp=1, args=(path,))
    m = torch.load(path)
    base = m[0]
    n = m["n0"]
    assert base == {"params": 4 * n, "master": 0, "grads": 4 * n, "optim": 8 * n}
    expect = {1: (1, 1, 4), 2: (1, 4, 4), 3: (4, 4, 4)}  # divisor of params, grads, optim
    for zero, (dp_, dg, do) in expect.items():
        got = m[zero]
        for key, div in (("params", dp_), ("grads", dg), ("optim", do)):
            assert got[key] == pytest.approx(base[key] / div, rel=0.10), (zero, key, got)
        pred = zero_memory(n, 4, zero, dp=4)
        for key in ("params", "grads", "optim"):
            assert got[key] == pytest.approx(pred[key], rel=0.02), (zero, key, got, pred)
    assert m["bf16-0"] == {"params": 2 * n, "master": 4 * n, "grads": 4 * n, "optim": 8 * n}
    for zero in (0, 1, 2, 3):
        got, pred = m[f"bf16-{zero}"], zero_memory(n, 4, zero, dp=4, weight_elem=2)
        for key in ("params", "master", "grads", "optim"):
            assert got[key] == pytest.approx(pred[key], rel=0.02, abs=64), (zero, key, got, pred)


# -- checkpoints across levels and dp sizes (the real training loop) ------------------

def test_checkpoint_across_zero_levels(tmp_path):
    """A zero=3 dp=2 run's step-2 checkpoint (Adam state and parameters written whole,
    the level-0 format) resumes at zero=0 dp=1 with the same step-3 loss (the same
    weights on the same global batch: tolerance as in test_reshard.py) and a step-4
    loss that needs the Adam moments; and at the same layout the resume is exact."""
    from tests.support.configs import CKPT_RUN
    from tests.support.loop import records, train_workers
    from tests.support.runs import resume_copy

    def train(out, world, *extra):
        train_workers(out, world, [*CKPT_RUN, "parallel.tp=1", *extra])

    a = tmp_path / "a"
    train(a, 2, "train.micro_batch_size=2", "parallel.zero=3", "parallel.dp_bucket_mb=0.1")
    ra = records(a)
    b = resume_copy(a, tmp_path / "b")
    train(b, 1, "train.micro_batch_size=4", "parallel.zero=0", "resume=auto")
    rb = records(b)
    assert rb[3]["loss"] == pytest.approx(ra[3]["loss"], rel=1e-5, abs=0)
    assert rb[4]["loss"] == pytest.approx(ra[4]["loss"], rel=1e-4, abs=0)
    c = resume_copy(a, tmp_path / "c")
    train(c, 2, "train.micro_batch_size=2", "parallel.zero=3", "parallel.dp_bucket_mb=0.1",
          "resume=auto")
    rc = records(c)
    for s in (3, 4):
        assert rc[s]["loss"] == ra[s]["loss"] and rc[s]["grad_norm"] == ra[s]["grad_norm"]


# -- per-block levels from a plan; pipelines ------------------------------------------

MIXED = [3, 1, 2, 0, 3, 2]   # embedding, attn/mlp of 2 layers, head


def _plan_body(ctx, plan_dir):
    """Per-block levels (and per-block TP degrees: blocks at degree 1 shard over their
    replicas too) from a plan file against the same plan at level 0."""
    import yaml

    degrees = [2, 1, 1, 2]
    paths = {}
    for name, zero in (("ref", [0] * 6), ("mixed", MIXED)):
        paths[name] = f"{plan_dir}/{name}.yaml"
        if ctx.rank == 0:
            with open(paths[name], "w") as f:
                yaml.safe_dump({"degrees": degrees, "tp": 2, "zero": zero}, f)
    dist.barrier()
    out = {}
    for name, path in paths.items():
        res = run_levels(ctx, (0,), "oases", "fine", (f"parallel.plan={path}",))
        out[name] = res[0]
    for a, b in zip(out["mixed"][:2], out["ref"][:2]):
        assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=0)
    for name, p in out["mixed"][2].items():
        assert_close(p, out["ref"][2][name], rtol=0, atol=PARAM_ATOL, msg=name)


def test_zero_levels_from_a_plan(tmp_path):
    run_distributed(_plan_body, world=4, tp=2, args=(str(tmp_path),))


def _pp_body(rank, schedule, recompute, plan=None):
    """pp 2 x dp 2 (tied embeddings across the stages): zero 3 equals zero 0, stage by
    stage; with ``plan``, per-block levels from a plan file that leaves the first stage
    at level 0 and shards the second's."""
    from oases.parallel.groups import build_pipeline_context
    from oases.parallel.layout import uniform_layout

    res = {}
    other = ("parallel.zero=3",) if plan is None else (f"parallel.plan={plan}",)
    for name, extra in (("0", ("parallel.zero=0",)), ("3", other)):
        cfg = zero_config(4, 1, 0, schedule, recompute,
                   ("parallel.pp=2", "train.grad_accum=3", "train.micro_batch_size=2", *extra))
        layout = uniform_layout(4, 2, 1, cfg.model.n_layer)
        ctx = build_pipeline_context(layout, torch.device("cpu"), bool(cfg.model.tie_embeddings))
        ts, model, engine, opt, reducer, pipe, batches = build_rank(cfg, ctx,
                                                                 cfg.pipeline_batch // ctx.dp)
        losses = [train_step(ts, batches, lr_at(s, cfg.train)) for s in range(STEPS)]
        with reducer.ownership.unsharded(opt, model):
            params = {k: p.detach().clone() for k, p in model.named_parameters()}
        res[name] = (losses, params)
    for name in ("3",):
        assert_close(torch.tensor(res[name][0]), torch.tensor(res["0"][0]), rtol=1e-5, atol=0,
                     msg=f"zero={name} losses, norms")
        for k, p in res[name][1].items():
            assert_close(p, res["0"][1][k], rtol=0, atol=PARAM_ATOL, msg=f"zero={name} {k}")


@pytest.mark.parametrize("schedule,recompute", [("megatron", "none"), ("oases", "fine")])
def test_zero_in_a_pipeline(schedule, recompute):
    run_distributed(_pp_body, world=4, tp=None, args=(schedule, recompute))


def test_zero_plan_levels_differ_between_stages(tmp_path):
    import yaml

    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"zero": [0, 0, 0, 3, 2, 3]}))  # stage 1 only
    run_distributed(_pp_body, world=4, tp=None, args=("megatron", "none", str(plan)))


# -- every recompute mode, active clipping, the non-finite check -----------------------

def _modes_body(ctx):
    """Level 3 (and 2) equal level 0 under the recompute modes not covered above, with a
    clipping threshold below the gradient norm (clipping scales the owned pieces)."""
    for schedule, recompute in (("megatron", "full"), ("oases", "none"), ("oases", "full")):
        res = run_levels(ctx, (0, 2, 3), schedule, recompute, ("train.grad_clip=0.05",))
        ref_l, ref_n, ref_p, _ = res[0]
        assert min(ref_n) > 0.05  # clipping is active
        for zero in (2, 3):
            losses, norms, params, _ = res[zero]
            what = f"{schedule}+{recompute} zero={zero}"
            assert_close(torch.tensor(losses), torch.tensor(ref_l), rtol=1e-5, atol=0, msg=what)
            assert_close(torch.tensor(norms), torch.tensor(ref_n), rtol=1e-5, atol=0, msg=what)
            for name, p in params.items():
                assert_close(p, ref_p[name], rtol=0, atol=PARAM_ATOL, msg=f"{what} {name}")


@pytest.mark.slow  # ~6 s; test_zero_levels_match_replicated is ZeRO's fast-tier check
def test_zero_under_every_recompute_mode_with_clipping():
    run_distributed(_modes_body, world=2, tp=1)


def _nonfinite_body(ctx):
    """A NaN in one rank's gradient, which the reduce-scatter puts into one owned range:
    every rank sees a non-finite norm and no weight (or Adam state) moves."""
    import math

    for zero in (2, 3):
        cfg = zero_config(ctx.world_size, 1, zero, "oases", "fine")
        ts, model, engine, opt, reducer, pipe, batches = build_rank(cfg, ctx)
        train_step(ts, batches, 1e-3)
        with reducer.ownership.unsharded(opt, model) as o:
            before = {k: p.detach().clone() for k, p in model.named_parameters()}
            moments = {id(p): o.state[p]["exp_avg"].clone() for p in model.parameters()}
        h = (model.layers[1].mlp.fc.weight.register_hook(lambda g: g * float("nan"))
             if ctx.rank == 0 else None)
        loss, norm = train_step(ts, batches, 1e-3)
        assert math.isfinite(loss) and math.isnan(norm), (ctx.rank, zero, loss, norm)
        with reducer.ownership.unsharded(opt, model) as o:
            for k, p in model.named_parameters():
                assert torch.equal(p, before[k]), f"zero={zero}: {k} moved in a skipped step"
                assert torch.equal(o.state[p]["exp_avg"], moments[id(p)]), k
        if h is not None:
            h.remove()


def test_zero_nonfinite_gradient_skips_the_step():
    run_distributed(_nonfinite_body, world=2, tp=1)


def test_zero_cost_model_arithmetic():
    """The planner's per-level figures: memory divides as the table says, traffic and
    the exposed time follow the overlap rule (hidden when compute covers it)."""
    from oases.planner.zero_cost import zero_exposed_s, zero_memory, zero_traffic

    n = 1000
    assert zero_memory(n, 4, 0, 4) == {"params": 4000, "grads": 4000, "optim": 8000}
    assert zero_memory(n, 4, 3, 4) == {"params": 1000, "grads": 1000, "optim": 2000}
    assert zero_memory(n, 4, 3, 1) == zero_memory(n, 4, 0, 1)
    assert zero_traffic(n, 4, 0, 2) == 4000 == zero_traffic(n, 4, 2, 2)
    assert zero_traffic(n, 4, 3, 2) == 6000
    # the node-local secondary shard (L = 2, bf16): its own row, one gather less across
    assert zero_memory(n, 4, 3, 4, secondary=2, sec_elem=2) == {
        "params": 1000, "grads": 1000, "optim": 2000, "secondary": 1000}
    assert "secondary" not in zero_memory(n, 4, 2, 4, secondary=2)
    assert zero_traffic(n, 4, 3, 2, secondary=2) == 4000
    piece = 2000 / 1e3  # (dp-1)/dp n e / link: 2 s
    assert zero_exposed_s(n, 4, 3, 2, 1e3, 10, 10) == 0.0             # all hidden
    assert zero_exposed_s(n, 4, 3, 2, 1e3, 0, 0) == pytest.approx(4 * piece)
    assert zero_exposed_s(n, 4, 1, 2, 1e3, 10, 10) == pytest.approx(piece)  # after the step
    assert zero_exposed_s(n, 4, 0, 2, 1e3, 0, 1) == pytest.approx(2 * piece - 1)


def _grads_after_step_body(ctx):
    for level in (2, 3):
        cfg = zero_config(ctx.world_size, 1, level, "megatron", "none")
        ts, model, engine, opt, reducer, pipe, batches = build_rank(cfg, ctx)
        for step in range(2):  # the second step gives the views back and runs as the first
            train_step(ts, batches, lr_at(step, cfg.train))
            sharded = [p for b in reducer.buckets if b.level >= 2 for p in b.params]
            assert sharded and all(p.grad is None for p in sharded), level
            for p in model.parameters():  # what a user's grad logging reads: no freed memory
                if p.grad is not None:
                    assert p.grad.untyped_storage().size() > 0
                    p.grad.float().sum().item()


def test_no_gradient_views_freed_memory_after_a_sharded_step():
    """Levels 2 and 3 free the whole gradient buffer after the reduce-scatter; the
    parameters' ``.grad`` views into it are dropped then (reading one segfaulted)."""
    run_distributed(_grads_after_step_body, world=2, tp=1)
