"""A model with a DP gradient reducer (and, under ZeRO-3, its parameter store) is freed
once nothing refers to it, whether or not the reducer was closed.

The reducer's hooks live in the parameters' C++ autograd metadata, which the cycle
collector cannot see into: a hook holding the reducer strongly keeps the reducer, and
through it every parameter, alive for good. ``plan=auto`` and ``plan_trials`` build such
models and throw them away, so a leak there keeps a whole model beside the run's.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from oases.models import build_model
from oases.config import load_config
from oases.dp.reducer import GradReducer
from tests.support.distributed import run_distributed


def _trained(ctx, level: int):
    """A model and its reducer after one armed step (every hook has fired)."""
    cfg = load_config(None, ["model.name=gpt-tiny", "model.seq_len=16",
                             "data.kind=synthetic"]).validate(2)
    model = build_model(cfg.model, cfg.padded_vocab_size, None, seed=3)
    tied = bool(cfg.model.tie_embeddings)
    reducer = GradReducer(model, ctx.dp_group, bucket_mb=0.05, level_of=lambda p: level,
                          tied_head=tied, zero=level > 0)
    assert reducer._handles, "the reducer must hook the parameters for this test to mean much"
    if level >= 3:
        assert reducer.ownership.store is not None and reducer.ownership.handles
    ids = torch.randint(0, cfg.model.vocab_size, (2, 16))
    reducer.zero_grad()
    reducer.arm()
    model(ids, ids).backward()
    reducer.finish()
    return model, reducer


def _freed_body(ctx, level: int, close: bool):
    gc.collect()
    model, reducer = _trained(ctx, level)
    params = [weakref.ref(p) for p in model.parameters()]
    red = weakref.ref(reducer)
    if close:
        reducer.close()
    del model, reducer
    gc.collect()
    alive = sum(p() is not None for p in params)
    assert alive == 0, f"{alive} of {len(params)} parameters outlive their model " \
                       f"(ZeRO level {level}, close={close})"
    assert red() is None


# each level and each way of dropping once in `make test-fast`, every pair in `make test`
@pytest.mark.parametrize("close,level", [
    pytest.param(True, 0, id="closed-0", marks=pytest.mark.slow),
    pytest.param(True, 3, id="closed-3"),
    pytest.param(False, 0, id="never-closed-0"),
    pytest.param(False, 3, id="never-closed-3", marks=pytest.mark.slow)])
def test_a_dropped_model_is_freed(level, close):
    run_distributed(_freed_body, world=2, tp=1, args=(level, close))


def _kept_body(ctx):
    """Hooks holding the reducer weakly still reduce while the reducer lives."""
    model, reducer = _trained(ctx, 0)
    x = torch.randint(0, 100, (2, 16))
    for step in range(2):  # the second armed backward launches buckets from the hooks
        reducer.zero_grad()
        reducer.arm()
        model(x + ctx.dp_rank, x).backward()
        launched = sum(b.work is not None for b in reducer.buckets)
        reducer.finish()
    assert launched == len(reducer.buckets), (launched, len(reducer.buckets))
    p = next(model.parameters())
    reps = [torch.empty_like(p.grad) for _ in range(2)]
    torch.distributed.all_gather(reps, p.grad.contiguous(), group=ctx.dp_group)
    assert torch.equal(reps[0], reps[1])
    reducer.close()


def test_hooks_reduce_while_the_reducer_lives():
    run_distributed(_kept_body, world=2, tp=1)
