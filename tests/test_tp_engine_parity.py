"""The TP engines: parity of every (engine, recompute) pair with plain autograd,
collective counts, saved-activation memory, and the block protocol on a toy block.

The reference (tests/support/parity.py) is plain autograd (``megatron``, ``none``) run
on each sub-batch alone from that sub-batch's RNG streams (``sub_batch_rng_streams``),
its losses averaged: that is the same computation, dropout masks included, that the oases
engine runs interleaved. Tolerance: fp32; the engines compute the same
operations on the same shards, and differ only in where gradients of a tensor
used twice (residual stream, tied embedding) are summed, i.e. in the order of
a few fp32 additions: errors ~1e-8 absolute on O(1e-2) gradients, checked at
atol 1e-6 / rtol 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from oases.models import build_model
from oases.config import load_config
from oases.errors import ConfigError
from oases.overlap.engines import OasesEngine, build_engine
from oases.overlap.memory import SavedTensorMeter
from oases.parallel import ColumnParallelLinear, RowParallelLinear, init_parameters
from oases.parallel.block import TPBlock
from oases.parallel.comm import CommCounter
from oases.parallel.random import TPRNGTracker
from tests.support.distributed import run_distributed
from tests.support.parity import PAIRS, full_grads, sub_batch_reference
from tests.support.toy_models import BlockStack

CPU = torch.device("cpu")
def _run_mode(ctx, cfg, mode, ids, y, n_sub=2):
    tracker = TPRNGTracker(ctx.device)
    tracker.seed(11, ctx.tp_rank, ctx.dp_rank)
    sched, rc = mode
    model = build_model(cfg.model, cfg.padded_vocab_size, ctx.tp_group, tracker,
                        rc if sched == "megatron" or rc == "selective" else "none", seed=3,
                        device=ctx.device)
    with CommCounter() as counter:
        if sched == "megatron":
            loss = sub_batch_reference(model, tracker, ids, y, n_sub)
        else:
            eng = build_engine("oases", ctx.tp_group, n_sub, rc, tracker)
            loss = eng.forward_backward(model, ids, y)
    return loss, full_grads(model, ctx), counter


def _parity_body(ctx, name, dropout, n_sub):
    cfg = load_config(None, [f"model.name={name}", f"parallel.tp={ctx.tp}",
                             f"model.dropout={dropout}", "model.n_layer=2"]).validate(ctx.world_size)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size, (2 * n_sub, 32), generator=g).to(ctx.device)
    y = torch.randint(0, cfg.model.vocab_size, (2 * n_sub, 32), generator=g).to(ctx.device)
    ref_loss, ref_grads, _ = _run_mode(ctx, cfg, ("megatron", "none"), ids, y, n_sub)
    for mode in PAIRS:
        loss, grads, _ = _run_mode(ctx, cfg, mode, ids, y, n_sub)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6, msg=str(mode))
        assert grads.keys() == ref_grads.keys()
        for k in grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-5, atol=1e-6,
                                       msg=f"{mode} {k}")
    # the check can fail: dropout masks matter (a different stream gives other grads)
    if dropout > 0:
        tracker = TPRNGTracker(ctx.device)
        tracker.seed(12, ctx.tp_rank)
        model = build_model(cfg.model, cfg.padded_vocab_size, ctx.tp_group, tracker, seed=3,
                            device=ctx.device)
        OasesEngine(ctx.tp_group, n_sub, "fine", tracker).forward_backward(model, ids, y)
        other = full_grads(model, ctx)
        assert max((other[k] - ref_grads[k]).abs().max() for k in other) > 1e-4


@pytest.mark.parametrize("name,world,dropout", [  # tp=4: slow tier, ~4 s
    ("gpt-tiny", 1, 0.1), ("gpt-tiny", 2, 0.1),
    pytest.param("gpt-tiny", 4, 0.1, marks=pytest.mark.slow),
    ("llama-tiny", 2, 0.1), ("gpt-tiny", 2, 0.0)])
def test_every_mode_matches_plain_autograd(name, world, dropout):
    run_distributed(_parity_body, world=world, tp=world, args=(name, dropout, 2))


def test_four_sub_batches_match():
    run_distributed(_parity_body, world=2, tp=2, args=("llama-tiny", 0.1, 4))


@pytest.mark.cuda(gpus=1)
@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_every_mode_on_one_gpu_shared_over_gloo(name):
    """Two ranks on one GPU, gloo with CUDA tensors: the overlapped schedule's kernels and
    its asynchronous collectives in the right order on the device (fp32, TF32 off by
    default; the same tolerances as on CPU), dropout masks from the CUDA generators."""
    run_distributed(_parity_body, world=2, tp=2, args=(name, 0.1, 2), device="cuda-shared")


def _count_body(ctx):
    cfg = load_config(None, ["model.name=gpt-tiny", "parallel.tp=2", "model.dropout=0.1",
                             "model.n_layer=3"]).validate(2)
    ids = torch.randint(0, 256, (4, 16))
    counts = {}
    for mode in [("megatron", "none")] + PAIRS:
        counts[mode] = _run_mode(ctx, cfg, mode, ids, ids)[2].counts["all_reduce"]
    L, n_sub = cfg.model.n_layer, 2
    base = counts[("megatron", "none")]  # plain autograd, once per sub-batch
    # per sub-batch: 1 embedding + 2 per layer forward, 2 per layer + 1 head backward,
    # 1 in the vocab-parallel loss (the per-rank max / sum / target-logit slots)
    assert base == n_sub * (1 + 2 * L + 2 * L + 1 + 1)
    assert counts[("oases", "fine")] == base          # fine never re-issues forward collectives
    assert counts[("oases", "none")] == base
    assert counts[("oases", "selective")] == counts[("megatron", "selective")] == base
    extra = n_sub * 2 * L                            # re-issued forward all-reduces
    assert counts[("oases", "full")] == base + extra
    assert counts[("megatron", "full")] == base + extra


def test_collective_counts():
    run_distributed(_count_body, world=2, tp=2)


def _memory_body(ctx, out):
    cfg = load_config(None, ["model.name=gpt-tiny", "parallel.tp=2", "model.dropout=0.1"]
                      ).validate(2)
    ids = torch.randint(0, 256, (8, 128))
    res = {}
    for sched, rc in [("megatron", "none"), ("megatron", "full"), ("oases", "none"),
                      ("oases", "selective"), ("oases", "full"), ("oases", "fine")]:
        tracker = TPRNGTracker(CPU)
        tracker.seed(1, ctx.tp_rank)
        model = build_model(cfg.model, cfg.padded_vocab_size, ctx.tp_group, tracker,
                            rc if sched == "megatron" or rc == "selective" else "none", seed=1)
        with SavedTensorMeter() as meter:
            build_engine(sched, ctx.tp_group, 2, rc, tracker).forward_backward(model, ids, ids)
        res[(sched, rc)] = meter.forward_bytes
    if ctx.rank == 0:
        out.update(res)
    none, fine, full = res[("oases", "none")], res[("oases", "fine")], res[("oases", "full")]
    assert full < fine < res[("oases", "selective")] < none, res
    assert res[("megatron", "full")] < res[("megatron", "none")]
    # fine keeps 2 (B, T, d) tensors per block; none keeps far more
    assert fine < 0.5 * none


def test_saved_activation_memory_orders_full_fine_none():
    run_distributed(_memory_body, world=2, tp=2, args=({},))


# ---- the block protocol on a toy, non-transformer model ----

class _Scale(TPBlock):
    """Block 0: replicated features -> column -> row partial (a projection)."""

    def __init__(self, d, tp_group):
        super().__init__(tp_group)
        self.a = ColumnParallelLinear(d, 4 * d, tp_group)
        self.b = RowParallelLinear(4 * d, d, tp_group, reduce_output=False)
        self.drop = nn.Dropout(0.2)

    def partial(self, x):
        return self.b.partial(torch.tanh(self.a(x)))

    def combine(self, x, reduced):
        return self.drop(self.b.add_bias(reduced))


class _Gate(TPBlock):
    """A gated residual block whose two column layers share one input (one cut)."""

    def __init__(self, d, tp_group):
        super().__init__(tp_group)
        self.u = ColumnParallelLinear(d, 2 * d, tp_group)
        self.v = ColumnParallelLinear(d, 2 * d, tp_group, bias=False)
        self.o = RowParallelLinear(2 * d, d, tp_group, reduce_output=False)

    def partial(self, x):
        return self.o.partial(torch.sigmoid(self.u(x)) * self.v(x))

    def combine(self, x, reduced):
        return x + F.dropout(self.o.add_bias(reduced), 0.1, self.training)


class _Toy(BlockStack):
    def __init__(self, d, tp_group):
        super().__init__([_Scale(d, tp_group), _Gate(d, tp_group), _Gate(d, tp_group)])


def _toy_body(ctx):
    torch.manual_seed(0)
    x, t = torch.randn(4, 6, 8), torch.randn(4, 6, 8)
    results = {}
    for mode in [("megatron", "none"), ("oases", "none"), ("oases", "full"), ("oases", "fine")]:
        model = _Toy(8, ctx.tp_group)
        init_parameters(model, 5, ctx.tp_rank, ctx.tp)
        torch.manual_seed(100)  # no tracker: the engine derives streams from the default one
        with CommCounter() as c:
            if mode[0] == "megatron":
                loss = sub_batch_reference(model, None, x, t, 2)
            else:
                loss = OasesEngine(ctx.tp_group, 2, mode[1]).forward_backward(model, x, t)
        results[mode] = (loss, full_grads(model, ctx), c.counts["all_reduce"])
    ref = results[("megatron", "none")]
    for mode, (loss, grads, n) in results.items():
        torch.testing.assert_close(loss, ref[0], rtol=1e-6, atol=1e-7)
        for k in grads:
            torch.testing.assert_close(grads[k], ref[1][k], rtol=1e-5, atol=1e-6, msg=f"{mode} {k}")
    # u and v share their input: the oases engine cuts it once (one backward all-reduce),
    # plain autograd all-reduces each column layer's input gradient
    assert results[("oases", "fine")][2] == ref[2] - 2 * 2  # 2 gate blocks x 2 sub-batches


def test_block_protocol_on_a_toy_model():
    run_distributed(_toy_body, world=2, tp=2)


def test_sub_batch_config_errors():
    with pytest.raises(ConfigError, match="sub-batches"):
        load_config(None, ["parallel.schedule=oases", "train.micro_batch_size=3",
                           "parallel.sub_batches=2"]).validate(1)
    with pytest.raises(ConfigError, match="sub-batches"):
        load_config(None, ["parallel.schedule=oases", "train.micro_batch_size=1",
                           "parallel.sub_batches=2"]).validate(1)
    # auto takes what the micro-batch allows (the run decides at start-up)
    odd = load_config(None, ["parallel.schedule=oases", "train.micro_batch_size=3"]).validate(1)
    assert odd.sub_batches == 1
    with pytest.raises(ConfigError, match="needs parallel.schedule=oases"):
        load_config(None, ["parallel.recompute=fine"]).validate(1)
    with pytest.raises(ConfigError, match="sub_batches=0 must be >= 1"):
        load_config(None, ["parallel.schedule=oases", "parallel.sub_batches=0"]).validate(1)
    one = load_config(None, ["parallel.schedule=oases", "parallel.sub_batches=1",
                             "train.micro_batch_size=1"]).validate(1)
    assert one.sub_batches == 1  # the micro-batch whole: no split, the engine's recompute
