"""ZeRO under bf16 gathers parameters in bf16 (the compute dtype): half the bytes of
every forward, recompute and backward gather of level 3, while each rank's owned range
stays the exact fp32 master that the optimizer steps and checkpoints write. With bf16
weights (``train.precision=bf16``) the post-step gathers of levels 1 and 2 move bf16 too.

Bytes: with the comm counter, a step's all-gather bytes in either bf16 mode are exactly
half of an fp32 run's (level 3; levels 1 and 2 with bf16 weights, whose autocast mode
gathers the fp32 parameters); the reduce-scatter (fp32 gradients) is unchanged.

Parity with ZeRO-0 under ``bf16-autocast`` (fp32 weights), 3 steps at dp = 2 (tests/support/zero_levels.py). The
matmuls cast their weights to bf16 under autocast either way; what the bf16 gather
changes is the weights of the ops that autocast runs in fp32 (layer norms, embedding
lookups), now bf16-rounded (relative 2^-9). Measured: the step-1 loss moves by 1.2e-5
relative and the gradient norms by 7e-4: rtol 1e-4 and 5e-3. Weights: Adam's first
steps move each element by about lr with the sign of its gradient, and elements whose
gradient is rounding noise can flip sign, so two bf16 runs that round differently agree
only to 2 lr per step (measured 3.6e-3 after 3 steps at lr 1e-3): atol 6e-3, the bound.
The master is checked exactly where it must be: the gathered inspection copy is the
fp32 master (not its rounding), and a bf16 run's step-1 loss differs from ZeRO-0's (the
gather was bf16).
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from oases.parallel.comm import CommCounter
from oases.runtime.step import train_step
from tests.support.distributed import run_distributed
from tests.support.zero_levels import build_rank, run_levels, zero_config


def _bytes_body(ctx, level):
    moved = {}
    for prec in ("fp32", "bf16-autocast", "bf16"):
        cfg = zero_config(ctx.world_size, 1, level, "megatron", "none",
                          (f"train.precision={prec}",))
        ts, model, engine, opt, reducer, pipe, batches = build_rank(cfg, ctx)
        train_step(ts, batches, 1e-3)
        with CommCounter() as c:
            train_step(ts, batches, 1e-3)
        moved[prec] = dict(c.bytes)
        shards = [b.zero for b in reducer.buckets if b.zero is not None]
        assert shards and all(z.shard.dtype == torch.float32 for z in shards)  # the master
        weights = torch.bfloat16 if prec == "bf16" else torch.float32
        assert all(p.dtype == weights for p in model.parameters()), prec
    half = ("bf16-autocast", "bf16") if level == 3 else ("bf16",)
    for prec in half:
        assert moved[prec]["all_gather"] * 2 == moved["fp32"]["all_gather"] > 0, moved
    if level < 3:  # the autocast mode's parameters are fp32: so is their post-step gather
        assert moved["bf16-autocast"]["all_gather"] == moved["fp32"]["all_gather"], moved
    kind = "all_reduce" if level == 1 else "reduce_scatter"
    for prec in ("bf16-autocast", "bf16"):
        assert moved[prec][kind] == moved["fp32"][kind] > 0, moved


@pytest.mark.parametrize("level", [2, 3])  # level 1's post-step gather is level 2's code
def test_zero_bf16_gathers_move_half_the_bytes(level):
    run_distributed(_bytes_body, world=2, tp=1, args=(level,))


def _parity_body(ctx, schedule, recompute):
    bf16 = ("train.precision=bf16-autocast",)
    res = run_levels(ctx, (0, 3), schedule, recompute, bf16)
    (l0, n0, p0, _), (l3, n3, p3, store) = res[0], res[3]
    assert l3[0] != l0[0], "the step-1 loss is ZeRO-0's exactly: no bf16 gather?"
    assert_close(torch.tensor(l3), torch.tensor(l0), rtol=1e-4, atol=0)
    assert_close(torch.tensor(n3), torch.tensor(n0), rtol=5e-3, atol=0)
    for name, p in p3.items():
        assert_close(p, p0[name], rtol=0, atol=6e-3, msg=lambda m, n=name: f"{n}: {m}")
    assert store[0] > 0
    # the inspection gather is the master: an fp32 value a bf16 rounding would change
    assert any((p != p.to(torch.bfloat16).float()).any() for p in p3.values())


@pytest.mark.parametrize("schedule,recompute,world,tp", [
    ("megatron", "none", 2, 1),
    pytest.param("oases", "fine", 4, 2, marks=pytest.mark.slow)])
def test_zero3_bf16_gathers_track_zero0(schedule, recompute, world, tp):
    run_distributed(_parity_body, world=world, tp=tp, args=(schedule, recompute))


@pytest.mark.slow
def test_zero3_bf16_resume_is_exact(tmp_path):
    """The checkpoint holds the fp32 master (the owned ranges), not the bf16 gathers: a
    resume at the same layout gives the same losses and norms, bit for bit."""
    from tests.support.configs import CKPT_RUN
    from tests.support.loop import check_exact_resume

    check_exact_resume(tmp_path, 2, [*CKPT_RUN, "parallel.tp=1", "train.micro_batch_size=2",
                                      "parallel.zero=3", "parallel.dp_bucket_mb=0.1",
                                      "train.precision=bf16-autocast"])
