"""``parallel.overlap_fb``: a micro-batch's backward interleaved with the next one's
forward gives the losses and gradients of the unpaired schedule, and of plain
autograd.

The reference is plain autograd run on each sub-batch of each micro-batch alone,
from that sub-batch's RNG streams (the replay rule of tests/test_tp_engine_parity.py), so
dropout 0.1 is checked mask for mask. Pairing changes only when the programs run,
not what they compute: against the unpaired engine, losses and gradients agree to
fp32 rounding of the accumulation (atol 1e-6 / rtol 1e-5, as the engine parity
tests); against plain autograd the same tolerance holds (the engines differ only
in where gradients of a tensor used twice are summed). Losing a micro-batch, the
wrong dropout stream or a mis-scaled gradient is off by percents.
"""

from __future__ import annotations

import pytest
import torch

from oases.models import build_model
from oases.config import load_config
from oases.errors import ConfigError
from oases.overlap.engines import MegatronEngine, OasesEngine
from oases.overlap.rng_streams import rng_restore, sub_batch_rng_streams
from oases.parallel.comm import CommCounter
from oases.parallel.random import TPRNGTracker
from oases.runtime.step import paired_forward_backward
from tests.support.distributed import run_distributed
from tests.support.parity import full_grads, run_case

CPU = torch.device("cpu")


def _model(ctx, cfg, seed=3):
    tracker = TPRNGTracker(CPU)
    tracker.seed(11, ctx.tp_rank, ctx.dp_rank)
    return build_model(cfg.model, cfg.padded_vocab_size, ctx.tp_group, tracker, seed=seed), tracker


def _plain(model, tracker, micro, n_sub):
    """Plain autograd on every sub-batch of every micro-batch, from its own streams."""
    losses = []
    for ids, y in micro:
        streams = sub_batch_rng_streams(tracker, CPU, n_sub)
        live = [None]
        parts = []
        for s, (a, b) in enumerate(zip(ids.chunk(n_sub), y.chunk(n_sub))):
            live[0] = tracker.get_states()
            rng_restore(tracker, CPU, streams[s])
            parts.append(MegatronEngine().forward_backward(model, a, b, 1.0 / (n_sub * len(micro))))
            tracker.set_states(live[0])
        losses.append(torch.stack(parts).mean())
    return losses


def _engine_body(ctx, name, grad_accum, n_sub):
    cfg = load_config(None, [f"model.name={name}", f"parallel.tp={ctx.tp}", "model.dropout=0.1",
                             "model.n_layer=2"]).validate(ctx.world_size)
    g = torch.Generator().manual_seed(0)
    micro = [(torch.randint(0, cfg.model.vocab_size, (2 * n_sub, 16), generator=g),
              torch.randint(0, cfg.model.vocab_size, (2 * n_sub, 16), generator=g))
             for _ in range(grad_accum)]
    seeds = [1.0 / grad_accum] * grad_accum
    results = {}
    for mode in ("plain", "unpaired", "paired"):
        model, tracker = _model(ctx, cfg)
        eng = OasesEngine(ctx.tp_group, n_sub, "fine", tracker)
        with CommCounter() as counter:
            if mode == "plain":
                losses = _plain(model, tracker, micro, n_sub)
            elif mode == "unpaired":
                losses = [eng.forward_backward(model, x, y, w) for (x, y), w in zip(micro, seeds)]
            else:
                losses = paired_forward_backward(eng, model, micro, seeds, _null, lambda: None)
        results[mode] = (torch.stack(losses), full_grads(model, ctx), dict(counter.counts))
    ref_losses, ref_grads, _ = results["plain"]
    for mode in ("unpaired", "paired"):
        losses, grads, _ = results[mode]
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6, msg=mode)
        for k in grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-5, atol=1e-6,
                                       msg=f"{mode} {name} ga={grad_accum} {k}")
    # collectives per step: pairing moves them, it neither adds nor drops one
    assert results["paired"][2] == results["unpaired"][2], (results["paired"][2],
                                                           results["unpaired"][2])


def _null():
    import contextlib
    return contextlib.nullcontext()


@pytest.mark.parametrize("name,grad_accum,n_sub", [
    ("gpt-tiny", 2, 2), ("llama-tiny", 4, 2), ("gpt-tiny", 4, 1), ("llama-tiny", 2, 1)])
def test_paired_engine_matches_plain_autograd(name, grad_accum, n_sub):
    run_distributed(_engine_body, world=2, tp=2, args=(name, grad_accum, n_sub))


def _cfg(name, fb, grad_accum, dropout, pp=1, tp=2, kind="eager-1f1b", world=4, n_sub=2,
         zero=0):
    return load_config(None, [f"parallel.zero={zero}",
        f"model.name={name}", "model.seq_len=16", f"model.dropout={dropout}", f"parallel.pp={pp}",
        f"parallel.tp={tp}", "parallel.schedule=oases", "parallel.recompute=fine",
        f"parallel.pp_schedule={kind}", f"parallel.overlap_fb={fb}", f"parallel.sub_batches={n_sub}",
        f"train.grad_accum={grad_accum}", "train.micro_batch_size=4", "train.warmup_steps=0",
        "data.kind=synthetic", "wandb.mode=disabled"]).validate(world)


def _train(ctx, cfg, steps=2):
    """Losses of ``steps`` train_step calls, the first step's gradients (under ZeRO the
    weights it produced) and collectives."""
    from oases.runtime.build import build_rank_model, seed_tracker, build_train_state
    from oases.runtime.data import TrainBatches
    from oases.runtime.step import train_step

    tracker = seed_tracker(cfg, ctx)
    model = build_rank_model(cfg, ctx, tracker, None, cfg.seed)
    ts = build_train_state(cfg, ctx, model, tracker)
    schedule, opt, reducer, pipe = ts.engine, ts.opt, ts.reducer, ts.pipe
    batches = TrainBatches(cfg.data, cfg.model.seq_len, cfg.model.vocab_size,
                           cfg.pipeline_batch // ctx.dp, ctx.dp_rank, ctx.dp, cfg.seed)
    pairs = [0]  # fused backward + forward calls (the check that pairing happened)
    if hasattr(schedule, "backward_forward"):
        fused = schedule.backward_forward

        def counted(*args, **kw):
            pairs[0] += 1
            return fused(*args, **kw)

        schedule.backward_forward = counted
    losses = []
    for s in range(steps):
        with CommCounter() as counter:
            loss, norm = train_step(ts, batches, cfg.train.lr)
        losses.append(loss)
        if s == 0:
            counts = dict(counter.counts)
            if reducer.ownership.sharded:  # ZeRO-2/3 keep only owned gradient ranges: compare weights
                with reducer.ownership.unsharded(opt, model):
                    grads = {k: p.detach().clone() for k, p in model.named_parameters()}
            else:
                grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    if pipe is None:  # pp=1: every backward but the last of each step
        want = steps * (cfg.train.grad_accum - 1)
    else:  # this stage's steady-state pairs
        from oases.pipeline.actions import is_fused
        want = steps * sum(is_fused(pipe.actions, i) for i in range(len(pipe.actions)))
    assert pairs[0] == (want if cfg.parallel.overlap_fb else 0), (pairs[0], want)
    return losses, grads, counts


def _compare(ctx, cfgs, what):
    (l0, g0, c0), (l1, g1, c1) = (_train(ctx, c) for c in cfgs)
    torch.testing.assert_close(torch.tensor(l1), torch.tensor(l0), rtol=1e-6, atol=1e-6,
                               msg=f"{what}: losses")
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-5, atol=1e-6, msg=f"{what}: {k}")
    if cfgs[0].parallel.zero == 3:  # parameter gathers: a pair keeps both passes' windows
        assert c1.pop("all_gather") <= c0.pop("all_gather"), (what, c1, c0)
    assert c1 == c0, (what, c1, c0)


def _dp_body(ctx, name, grad_accum, zero):
    """pp=1, dp 2 x tp 2, dropout 0.1: train_step with and without overlap_fb (ZeRO-3:
    the two passes' parameter gathers interleave too)."""
    _compare(ctx, [_cfg(name, fb, grad_accum, 0.1, zero=zero) for fb in (False, True)],
             f"dp2xtp2 {name} ga={grad_accum} zero={zero}")


@pytest.mark.parametrize("name,grad_accum,zero", [
    ("gpt-tiny", 2, 0), pytest.param("llama-tiny", 4, 0, marks=pytest.mark.slow),
    pytest.param("gpt-tiny", 4, 3, marks=pytest.mark.slow)])
def test_dp_tp_train_step_matches_unpaired(name, grad_accum, zero):
    run_distributed(_dp_body, world=4, tp=2, args=(name, grad_accum, zero))


def _pp_body(rank, name, grad_accum):
    """pp 2 x tp 2 (eager-1f1b), dropout 0.1: the pipeline runtime with and without fused
    B, F pairs; then dropout 0 against one unsharded process (test_pipeline_parity)."""
    from oases.parallel.groups import build_pipeline_context
    from oases.parallel.layout import uniform_layout

    cfgs = [_cfg(name, fb, grad_accum, 0.1, pp=2) for fb in (False, True)]
    layout = uniform_layout(4, 2, 2, cfgs[0].model.n_layer)
    ctx = build_pipeline_context(layout, CPU, bool(cfgs[0].model.tie_embeddings))
    _compare(ctx, cfgs, f"pp2xtp2 {name} ga={grad_accum}")
    cfg = _cfg(name, True, grad_accum, 0.0, pp=2)
    run_case(rank, cfg, layout, 2, f"pp2xtp2 {name} ga={grad_accum} vs unsharded")


@pytest.mark.parametrize("name,grad_accum", [("gpt-tiny", 2),
                                              pytest.param("llama-tiny", 4, marks=pytest.mark.slow)])
def test_pipeline_fused_pairs_match(name, grad_accum):
    run_distributed(_pp_body, world=4, tp=None, args=(name, grad_accum))


@pytest.mark.parametrize("overrides,message", [
    (["parallel.schedule=megatron"], "overlap_fb needs parallel.schedule=oases"),
    (["train.grad_accum=1"], "needs train.grad_accum >= 2"),
    (["parallel.pp=2", "train.grad_accum=2", "parallel.pp_schedule=1f1b"],
     "needs parallel.pp_schedule=eager-1f1b"),
    (["parallel.sub_batches=0"], "must be >= 1"),
])
def test_config_errors(overrides, message):
    base = ["parallel.schedule=oases", "parallel.overlap_fb=true", "parallel.tp=2",
            "train.grad_accum=2", "model.name=gpt-tiny"]
    with pytest.raises(ConfigError, match=message):
        load_config(None, base + overrides).validate(4)


def _paired_times(gbps: float, grad_accum: int):
    from oases.planner.cluster import Cluster
    from oases.planner.cost import CostModel, ModelShape, RunShape
    from oases.planner.fit import analytic_profile

    shape = ModelShape("gpt", 2, 256, 8, 8, 2048, 512, 128)
    cluster = Cluster("c", 2, 1, 4.0, 100.0, gbps)
    out = []
    for fb in (False, True):
        run = RunShape(tp=2, dp=1, micro_batch_size=8, grad_accum=grad_accum, sub_batches=2,
                       schedule="oases", recompute="fine", overlap_fb=fb)
        prof = analytic_profile(shape, run, [1, 2], flops_per_s=1e11)
        out.append(CostModel(shape, run, cluster, prof).plan_time([2, 2, 2, 2]))
    return out


def test_cost_model_pairs_only_what_hides():
    """The planner's paired timeline: on a fast link there is nothing to hide and
    pairing predicts the unpaired step; on a slow one (forward link-bound, backward
    compute-bound: the pair hides one in the other) it predicts
    a shorter step; with one micro-batch there is no pair."""
    fast, fast_fb = _paired_times(100.0, 4)
    assert fast_fb == pytest.approx(fast, rel=1e-9)
    slow, slow_fb = _paired_times(0.5, 4)
    assert slow_fb < 0.97 * slow, (slow, slow_fb)
    one, one_fb = _paired_times(0.5, 1)
    assert one_fb == one


def test_plan_auto_prices_the_paired_run_at_the_run_s_dp():
    """plan=auto prices the paired schedule on a copy of the validated config: the copy
    keeps dp (a dataclasses.replace copy had dp 0, which dropped the replicas' gradient
    syncs from the prediction and made degree-1 blocks look free)."""
    from oases.planner.online import paired_config

    cfg = load_config(None, ["model.name=gpt-tiny", "parallel.tp=2", "parallel.schedule=oases",
                             "train.grad_accum=2"]).validate(4)
    alt = paired_config(cfg)
    assert alt.parallel.overlap_fb and not cfg.parallel.overlap_fb
    assert alt.dp == cfg.dp == 2
