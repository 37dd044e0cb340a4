"""Collectives issued during a backward belong to the comm scope of its forward
(:class:`oases.parallel.comm.CommScope`), on whichever thread autograd runs them.

On CUDA autograd runs a backward on its device thread, whose thread-local scope is
empty. Here each backward runs on a fresh thread that entered no scope (on CPU autograd
runs the graph on the calling thread), while the counters, observers and no-op groups
stay entered on the main thread, as a traced or counted training step has them:
* the DP reducer's bucket launches (post-accumulate hooks) are counted and observed;
* ZeRO-3's gathers (hooks on the blocks' outputs) and reduce-scatters are counted;
* ``recompute=full``'s re-run forward all-reduces are counted, and skipped under
  :class:`~oases.parallel.comm.NoopCollectives` like the forward's;
* every TP op of :mod:`oases.parallel.comm` counts its backward collective.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from oases.models import build_model
from oases.dp.reducer import GradReducer
from oases.parallel.comm import (CommCounter, NoopCollectives, all_gather_to_tp, column_linear,
                                 copy_to_tp, gather_from_tp, reduce_from_tp, reduce_scatter_to_tp,
                                 scatter_to_tp)
from oases.runtime.build import seed_tracker
from tests.support.configs import tiny_config
from tests.support.distributed import run_distributed
from tests.support.threads import SeenCollectives, on_thread


def _cfg(tp: int):
    return tiny_config(world=2, seq_len=16, tp=tp)


def _ids(cfg):
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, cfg.model.vocab_size, (2, 16), generator=g)


def _calibrated(ctx, level: int):
    """gpt-tiny (tp 1) and a reducer of many small buckets after its calibrating step."""
    cfg = _cfg(1)
    model = build_model(cfg.model, cfg.padded_vocab_size, None, seed=3)
    reducer = GradReducer(model, ctx.dp_group, bucket_mb=0.05, level_of=lambda p: level,
                          tied_head=bool(cfg.model.tie_embeddings), zero=level > 0)
    ids = _ids(cfg)
    reducer.zero_grad()
    reducer.arm()
    model(ids, ids).backward()
    reducer.finish()
    return model, reducer, ids


# ---- DP buckets launched from gradient hooks ----

def _buckets_body(ctx):
    model, reducer, ids = _calibrated(ctx, 0)
    n = len(reducer.buckets)
    assert n >= 8, n
    reducer.zero_grad()
    with CommCounter() as c, SeenCollectives() as seen:
        loss = model(ids, ids)
        reducer.arm()
        on_thread(loss.backward)
        from_hooks = sum(b.work is not None for b in reducer.buckets)
        reducer.finish()
    assert from_hooks == n, f"{from_hooks} of {n} buckets launched during the backward"
    assert dict(c.counts) == {"all_reduce": n}
    assert seen.names == ["all-reduce"] * n
    reducer.close()


def test_bucket_launches_count_in_the_armed_scope():
    run_distributed(_buckets_body, world=2, tp=1)


# ---- ZeRO-3: gathers and reduce-scatters during the backward ----

def _zero3_body(ctx):
    model, reducer, ids = _calibrated(ctx, 3)

    def step(backward):
        reducer.zero_grad()
        with CommCounter() as c:
            with CommCounter() as fwd:
                loss = model(ids, ids)
            reducer.arm()
            backward(loss)
            reducer.finish()
        return dict(fwd.counts), dict(c.counts)

    fwd, here = step(lambda loss: loss.backward())
    fwd_t, there = step(lambda loss: on_thread(loss.backward))
    assert fwd_t == fwd and set(fwd) == {"all_gather"}
    assert there == here, (there, here)
    assert there["reduce_scatter"] == len(reducer.buckets)
    assert there["all_gather"] > fwd["all_gather"], "the backward gathers evicted blocks again"
    reducer.close()


def test_zero3_backward_collectives_count_in_the_forward_scope():
    run_distributed(_zero3_body, world=2, tp=1)


# ---- tensor parallelism: the comm ops and recompute=full ----

def _ops_body(ctx):
    g = ctx.tp_group
    w = torch.randn(6, 4)
    # op, its collectives forward and backward
    cases = [
        (lambda x: copy_to_tp(x, g), {}, {"all_reduce": 1}),
        (lambda x: reduce_from_tp(x, g), {"all_reduce": 1}, {}),
        (lambda x: scatter_to_tp(x, g, 0), {}, {"all_gather": 1}),
        (lambda x: gather_from_tp(x, g, 0), {"all_gather": 1}, {}),
        (lambda x: reduce_scatter_to_tp(x, g, 0), {"reduce_scatter": 1}, {"all_gather": 1}),
        (lambda x: all_gather_to_tp(x, g, 0), {"all_gather": 1}, {"reduce_scatter": 1}),
        (lambda x: column_linear(x, w, None, g), {}, {"all_reduce": 1}),
    ]
    for k, (op, fwd, bwd) in enumerate(cases):
        x = torch.randn(4, 4, requires_grad=True)
        with CommCounter() as c:
            y = op(x)
            assert dict(c.counts) == fwd, (k, dict(c.counts))
            on_thread(lambda: y.sum().backward())
        assert dict(c.counts) == dict(fwd, **bwd), (k, dict(c.counts))
        assert x.grad is not None and x.grad.shape == x.shape


def test_tp_ops_count_their_backward_in_the_forward_scope():
    run_distributed(_ops_body, world=2, tp=2)


def _tp_model(ctx, recompute: str):
    cfg = _cfg(ctx.tp)
    model = build_model(cfg.model, cfg.padded_vocab_size, ctx.tp_group, seed_tracker(cfg, ctx),
                        recompute, seed=3)
    model.train()
    return cfg, model


def _counts(ctx, recompute: str, elsewhere: bool, noop: bool = False):
    """(forward's, whole step's) collective counts and the parameter gradients of one
    forward and backward, the backward on a fresh thread if ``elsewhere``."""
    cfg, model = _tp_model(ctx, recompute)
    ids = _ids(cfg)
    with NoopCollectives(ctx.tp_group) if noop else contextlib.nullcontext(), \
            CommCounter() as c:
        loss = model(ids, ids)
        fwd = dict(c.counts)
        if elsewhere:
            on_thread(loss.backward)
        else:
            loss.backward()
    return fwd, dict(c.counts), [p.grad for p in model.parameters()]


def _recompute_body(ctx):
    n_layer = _cfg(ctx.tp).model.n_layer
    fwd, plain, g_plain = _counts(ctx, "none", elsewhere=False)
    assert _counts(ctx, "none", elsewhere=True)[:2] == (fwd, plain)
    fwd_full, full_here, _ = _counts(ctx, "full", elsewhere=False)
    fwd_full_t, full_there, g_full = _counts(ctx, "full", elsewhere=True)
    assert fwd_full == fwd_full_t == fwd
    # the re-run repeats each layer's attention all-reduce, and its MLP's unless
    # checkpoint's early stop ends the re-run once the saved tensors are back
    extra = full_here["all_reduce"] - plain["all_reduce"]
    assert n_layer <= extra <= 2 * n_layer, (full_here, plain)
    assert full_there == full_here, (full_there, full_here)
    for a, b in zip(g_plain, g_full):  # the re-run on another thread changes no gradient
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_recompute_full_counts_its_rerun_in_the_forward_scope():
    run_distributed(_recompute_body, world=2, tp=2)


def _noop_body(ctx):
    real = []
    orig = dist.all_reduce

    def spy(t, *args, group=None, **kwargs):
        if group is ctx.tp_group:
            real.append(tuple(t.shape))
        return orig(t, *args, group=group, **kwargs)

    _, counted, _ = _counts(ctx, "full", elsewhere=False)
    dist.all_reduce = spy
    try:
        _, skipped, _ = _counts(ctx, "full", elsewhere=True, noop=True)
    finally:
        dist.all_reduce = orig
    assert real == [], f"{len(real)} TP all-reduces ran under NoopCollectives: {real}"
    assert skipped == counted  # skipped, and still counted


def test_noop_skips_the_recompute_rerun():
    run_distributed(_noop_body, world=2, tp=2)


def test_a_one_rank_group_is_an_identity_never_the_world():
    """oases.parallel.comm's collectives take None (what oases.parallel.ranks gives for a
    group of one rank) as one rank, never torch's meaning of None, the whole world: no
    process group is needed to call them so."""
    import torch

    from oases.parallel.comm import CommCounter, all_gather_async, all_reduce, \
        reduce_scatter_async

    t = torch.arange(4.0)
    with CommCounter() as c:
        assert all_reduce(t, None) is None and all_reduce(t, None, async_op=True).wait()
        out, work = all_gather_async(t, None)
        assert work.wait() and torch.equal(out, t)
        out, work = reduce_scatter_async(t, None)
        assert work.wait() and torch.equal(out, t)
    assert torch.equal(t, torch.arange(4.0)) and not c.counts  # nothing crossed a link
