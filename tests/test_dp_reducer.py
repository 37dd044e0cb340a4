"""The DP reducer cannot be silently detached: ``optimizer.zero_grad()`` (which sets
``param.grad = None``) between steps is repaired, and between ``reducer.zero_grad()``
and the backward it is an error that names the cause."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support.distributed import run_distributed


def _setup(ctx):
    from oases.models import build_model
    from oases.config import load_config
    from oases.dp.reducer import GradReducer
    from oases.runtime.data import TrainBatches
    from oases.runtime.optim import build_optimizer

    cfg = load_config(None, ["model.name=gpt-tiny", "model.seq_len=16", "data.kind=synthetic",
                             "train.micro_batch_size=2", "train.warmup_steps=0"]).validate(2)
    model = build_model(cfg.model, cfg.padded_vocab_size, None, seed=3)
    model.train()
    opt = build_optimizer(model, cfg.train, ctx.device)
    reducer = GradReducer(model, ctx.dp_group)
    batches = TrainBatches(cfg.data, 16, cfg.model.vocab_size, 2, ctx.dp_rank, ctx.dp, cfg.seed)
    return cfg, model, opt, reducer, batches


def _same_over_dp(model, ctx) -> None:
    for name, p in model.named_parameters():
        reps = [torch.empty_like(p) for _ in range(ctx.dp)]
        dist.all_gather(reps, p.detach().contiguous(), group=ctx.dp_group)
        assert torch.equal(reps[0], reps[1]), f"{name} differs over dp: DP did not sync"


def _repaired(ctx):
    from oases.runtime.step import TrainState, train_step

    cfg, model, opt, reducer, batches = _setup(ctx)
    for _ in range(2):
        train_step(TrainState(cfg, ctx, model, opt, reducer), batches, 1e-2)
        opt.zero_grad(set_to_none=True)  # what a hand-written loop does
    _same_over_dp(model, ctx)


def _detected(ctx):
    from oases.overlap.engines import MegatronEngine

    cfg, model, opt, reducer, batches = _setup(ctx)
    reducer.zero_grad()
    opt.zero_grad(set_to_none=True)
    x, y = batches.next_batch()
    reducer.arm()
    MegatronEngine().forward_backward(model, x, y)
    with pytest.raises(RuntimeError, match=r"no longer the DP reducer's bucket view "
                                           r"\(optimizer.zero_grad\(\)"):
        reducer.finish()


def test_zero_grad_between_steps_is_repaired():
    run_distributed(_repaired, world=2, tp=1)


def test_zero_grad_before_backward_is_an_error():
    run_distributed(_detected, world=2, tp=1)


class _Launches:
    """A collective observer that records when each all-reduce was launched."""

    def __init__(self):
        from oases.parallel.comm import CommObserver

        class Obs(CommObserver):
            def __init__(self, times):
                self.times = times

            def collective(self, name, lane, work, start=None):
                self.times.append(start)

        self.times: list[float] = []
        self.obs = Obs(self.times)


def _launch_during_backward(ctx):
    import time

    from oases.dp.reducer import GradReducer

    cfg, model, opt, _, batches = _setup(ctx)
    reducer = GradReducer(model, ctx.dp_group, bucket_mb=0.05)  # many small buckets
    n_buckets = len(reducer.buckets)
    assert n_buckets >= 8, n_buckets
    for step in range(2):  # the first armed backward calibrates (counts hooks)
        reducer.zero_grad()
        x, y = batches.next_batch()
        loss = model(x, y)
        rec = _Launches()
        with rec.obs:
            reducer.arm()
            loss.backward()
            t_end = time.perf_counter()
            reducer.finish()
        early = sum(t < t_end for t in rec.times)
        if step == 1:  # every bucket but the one holding the first layers' gradients
            assert len(rec.times) == n_buckets and early >= n_buckets - 2, (early, n_buckets)
    _same_over_dp(model, ctx)


def test_buckets_launch_during_backward():
    run_distributed(_launch_during_backward, world=2, tp=1)
