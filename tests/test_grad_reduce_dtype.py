"""``parallel.grad_reduce_dtype=bf16``: DP and ZeRO sum gradients in bf16 on the wire and
accumulate them in fp32, at every ZeRO level.

Bytes: with the comm counter, one training step moves exactly 2 bytes less per bucket
element in bf16 (each bucket's all-reduce at levels 0-1, its reduce-scatter at 2-3); the
rest (loss and norm reductions, ZeRO-3's parameter gathers) is unchanged.

Parity against the fp32 reduction, 3 steps at dp = 2 (tests/support/zero_levels.py).
Each gradient element is rounded to bf16 once before the sum (relative error at most
2^-9) and the two-operand sum rounded once more (2^-9): about 0.4% per element at
worst. The gradient norm, a root of a sum of squares of such elements, moves by less
than that: rtol 1e-2 is 2.5x the worst case. The loss of step 1 is computed before any
update, so it is equal; later losses move by an update's rounding (lr 1e-3 times a
0.4% change of Adam's direction, measured ~1e-5 relative): rtol 1e-3. Weights: Adam's
per-element step m / (sqrt(v) + eps) is at most about lr per step, and an element whose
exact gradient is rounding noise can flip it; 3 steps at lr 1e-3 bound every move by
3e-3, so ``atol=3e-3`` only says the run trained the same weights, and the byte count
and the norm are what fail on a wrong reduction (a lost 1/dp doubles the norm). Each
bf16 run is also checked to differ from the fp32 run (the wire dtype was applied).
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from oases.errors import ConfigError
from oases.parallel.comm import CommCounter
from oases.runtime.optim import lr_at
from oases.runtime.step import train_step
from tests.support.distributed import run_distributed
from tests.support.zero_levels import build_rank, run_levels, zero_config

BF16 = ("parallel.grad_reduce_dtype=bf16",)


def _bytes_body(ctx, level):
    moved, elems = {}, {}
    for wire, extra in (("fp32", ()), ("bf16", BF16)):
        cfg = zero_config(ctx.world_size, 1, level, "megatron", "none", extra)
        ts, model, engine, opt, reducer, pipe, batches = build_rank(cfg, ctx)
        train_step(ts, batches, lr_at(0, cfg.train))  # calibration step
        with CommCounter() as c:
            train_step(ts, batches, lr_at(1, cfg.train))
        moved[wire] = sum(c.bytes.values())
        elems[wire] = sum(b.buffer.numel() for b in reducer.buckets)
        kinds = set(c.counts)
        assert ("reduce_scatter" in kinds) == (level >= 2), kinds
    assert elems["fp32"] == elems["bf16"] > 0
    assert moved["fp32"] - moved["bf16"] == 2 * elems["fp32"], (moved, elems)


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_bf16_reduction_moves_half_the_gradient_bytes(level):
    run_distributed(_bytes_body, world=2, tp=1, args=(level,))


def _parity_body(ctx, schedule, recompute, levels):
    ref = run_levels(ctx, (0,), schedule, recompute)[0]
    got = run_levels(ctx, levels, schedule, recompute, BF16)
    for level in levels:
        losses, norms, params, _ = got[level]
        assert losses[0] == ref[0][0], (level, losses, ref[0])
        assert_close(torch.tensor(losses), torch.tensor(ref[0]), rtol=1e-3, atol=0,
                     msg=f"zero={level} losses")
        assert_close(torch.tensor(norms), torch.tensor(ref[1]), rtol=1e-2, atol=0,
                     msg=f"zero={level} norms")
        assert norms != ref[1], f"zero={level}: the bf16 sum gave fp32's norms exactly"
        for name, p in params.items():
            assert_close(p, ref[2][name], rtol=0, atol=3e-3,
                         msg=lambda m, n=name: f"zero={level} {n}: {m}")


@pytest.mark.parametrize("schedule,recompute,world,tp,levels", [
    ("megatron", "none", 2, 1, (0, 1, 2, 3)),
    pytest.param("oases", "fine", 4, 2, (0, 3), marks=pytest.mark.slow)])
def test_bf16_reduction_tracks_fp32(schedule, recompute, world, tp, levels):
    run_distributed(_parity_body, world=world, tp=tp, args=(schedule, recompute, levels))


def test_grad_reduce_dtype_is_checked():
    with pytest.raises(ConfigError, match=r"parallel.grad_reduce_dtype='fp16' is not one of "
                                          r"fp32, bf16"):
        zero_config(2, 1, 0, "megatron", "none", ("parallel.grad_reduce_dtype=fp16",))


def test_the_planner_prices_the_reduce_dtype():
    """The cost model's gradient sync and the ZeRO traffic row move half the gradient
    bytes at bf16: with no latency, the sync's wire time halves exactly."""
    import random

    from oases.planner.cluster import Cluster
    from oases.planner.cost import CostModel, ModelShape, Profile, RunShape
    from oases.planner.stages import job_from_config
    from oases.planner.zero_cost import zero_traffic

    shape = ModelShape("gpt", 3, 256, 8, 8, 1024, 512, 64)
    rng = random.Random(3)
    blocks = {k: {str(t): {"fwd": rng.uniform(1e-3, 2e-2), "bwd": rng.uniform(2e-3, 4e-2),
                           "saved": rng.uniform(1e6, 4e7)} for t in (1, 2)}
              for k in ("attn", "mlp")}
    prof = Profile(blocks, {"fwd": 1e-3, "bwd": 2e-3, "step": 1e-3, "peak": 1e6})
    cluster = Cluster("c", 2, 2, 80, 100, 10)
    sync = {}
    for nbytes in (4, 2):
        run = RunShape(2, 2, 8, 1, 2, "oases", "fine", grad_reduce_bytes=nbytes)
        sync[nbytes] = CostModel(shape, run, cluster, prof).sync
    assert sync[4] and sync[4].keys() == sync[2].keys()
    for key, s in sync[4].items():
        assert s > 0 and sync[2][key] == pytest.approx(s / 2), key
    n = 1000
    assert zero_traffic(n, 4, 0, 2, reduce_elem=2) == zero_traffic(n, 4, 0, 2) / 2
    assert zero_traffic(n, 4, 3, 2, reduce_elem=2) == (2 + 4 + 4) / 2 * n  # RS bf16 + 2 AG
    cfg = zero_config(2, 1, 0, "megatron", "none", BF16)
    assert job_from_config(cfg).grad_reduce_bytes == 2
    assert job_from_config(zero_config(2, 1, 0, "megatron", "none")).grad_reduce_bytes == 4
