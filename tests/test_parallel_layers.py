"""Tensor-parallel building blocks against their unsharded PyTorch equivalents.

Every check builds the *full* (unsharded) tensors from a fixed seed on every rank,
runs the plain ``nn.Linear`` / ``nn.Embedding`` / ``F.cross_entropy`` reference
locally, and compares this rank's sharded result with the matching shard of the
reference (and, for weights, the gathered + unsharded gradient with the full one).

tp=1 runs in-process with ``tp_group=None`` (the layers must then be plain
layers); tp=2/4 run in gloo worker processes (tests/support/distributed.py).

Tolerances: fp32 throughout. A sharded matmul sums the same products as the
unsharded one but in a different order (partial sums over in/tp, then the
all-reduce), so results agree to a few ulps (~1e-7 relative here, values O(1)):
``torch.testing.assert_close``'s fp32 defaults (rtol 1.3e-6, atol 1e-5) are ample
while still catching any wrong shard, missing reduction or doubled gradient.
Pure data movement (gather/scatter/embedding lookup) is compared exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

from oases.parallel.comm import all_reduce, reduce_from_tp
from oases.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from oases.parallel.loss import vocab_parallel_cross_entropy
from oases.parallel.sharding import TPSpec, init_parameters, shard, unshard
from tests.support.distributed import run_distributed

# ---------------------------------------------------------------------------
# helpers usable both in-process (group=None) and in a worker


def _gather_list(t: torch.Tensor, group, tp: int) -> list[torch.Tensor]:
    """Every TP rank's copy of ``t`` (same shape on all ranks), in TP rank order."""
    if tp == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(out, t.detach().contiguous(), group=group)
    return out


def _rand(gen: torch.Generator, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


def _copy_full_into(param: nn.Parameter, full: torch.Tensor, rank: int, tp: int) -> None:
    with torch.no_grad():
        param.copy_(shard(full, param.tp_spec, rank, tp))


# ---------------------------------------------------------------------------
# ColumnParallelLinear


def _check_column(group, rank: int, tp: int, bias: bool, parts, gather_output: bool) -> None:
    gen = torch.Generator().manual_seed(100)
    IN = 6
    OUT = sum(parts) if parts else 12
    B, T = 2, 3
    W, b = _rand(gen, OUT, IN), _rand(gen, OUT)
    x, dy = _rand(gen, B, T, IN), _rand(gen, B, T, OUT)

    ref = nn.Linear(IN, OUT, bias=bias)
    with torch.no_grad():
        ref.weight.copy_(W)
        if bias:
            ref.bias.copy_(b)
    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref)
    (y_ref * dy).sum().backward()

    layer = ColumnParallelLinear(IN, OUT, group, bias=bias, gather_output=gather_output,
                                 parts=parts)
    spec = layer.weight.tp_spec
    assert spec == TPSpec(0, (OUT, IN), tuple(parts) if parts else None)
    assert layer.weight.shape == (OUT // tp, IN)
    assert layer.local_parts == tuple(p // tp for p in (parts or (OUT,)))
    _copy_full_into(layer.weight, W, rank, tp)
    if bias:
        assert layer.bias.tp_spec == TPSpec(0, (OUT,), tuple(parts) if parts else None)
        _copy_full_into(layer.bias, b, rank, tp)
    else:
        assert layer.bias is None

    xs = x.clone().requires_grad_()
    y = layer(xs)
    out_spec = TPSpec(2, (B, T, OUT), tuple(parts) if parts else None)
    if gather_output:
        assert y.shape == (B, T, OUT)
        assert_close(y, y_ref)
        dy_local = dy
    else:
        assert y.shape == (B, T, OUT // tp)
        assert_close(y, shard(y_ref, out_spec, rank, tp))
        dy_local = shard(dy, out_spec, rank, tp)
    (y * dy_local).sum().backward()

    # copy_to_tp's backward all-reduces the input gradient: the full gradient on every rank
    assert_close(xs.grad, x_ref.grad)
    assert_close(layer.weight.grad, shard(ref.weight.grad, spec, rank, tp))
    assert_close(unshard(_gather_list(layer.weight.grad, group, tp), spec), ref.weight.grad)
    if bias:
        assert_close(layer.bias.grad, shard(ref.bias.grad, layer.bias.tp_spec, rank, tp))
        assert_close(unshard(_gather_list(layer.bias.grad, group, tp), layer.bias.tp_spec),
                     ref.bias.grad)

    if parts and tp > 1:
        # the local output really is [q_r | k_r | v_r], not a contiguous chunk of the full output
        naive = y_ref.chunk(tp, dim=-1)[rank]
        assert not torch.allclose(y, naive)


def _check_column_gather_with_parts_refused(group) -> None:
    layer = ColumnParallelLinear(4, 8, group, parts=(4, 4), gather_output=True)
    with pytest.raises(ValueError, match="gather_output"):
        layer(torch.zeros(1, 4))


# ---------------------------------------------------------------------------
# RowParallelLinear


def _check_row(group, rank: int, tp: int, bias: bool, input_is_parallel: bool,
               reduce_output: bool) -> None:
    gen = torch.Generator().manual_seed(200)
    IN, OUT, B, T = 8, 5, 2, 3
    W, b = _rand(gen, OUT, IN), _rand(gen, OUT)
    x, dy = _rand(gen, B, T, IN), _rand(gen, B, T, OUT)

    ref = nn.Linear(IN, OUT, bias=bias)
    with torch.no_grad():
        ref.weight.copy_(W)
        if bias:
            ref.bias.copy_(b)
    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref)
    (y_ref * dy).sum().backward()

    layer = RowParallelLinear(IN, OUT, group, bias=bias, input_is_parallel=input_is_parallel,
                              reduce_output=reduce_output)
    spec = layer.weight.tp_spec
    assert spec == TPSpec(1, (OUT, IN))
    assert layer.weight.shape == (OUT, IN // tp)
    _copy_full_into(layer.weight, W, rank, tp)
    if bias:
        assert layer.bias.tp_spec is None and layer.bias.shape == (OUT,)  # replicated
        _copy_full_into(layer.bias, b, rank, tp)

    x_spec = TPSpec(2, (B, T, IN))
    x_local = shard(x, x_spec, rank, tp)
    x_in = (x_local if input_is_parallel else x).clone().requires_grad_()
    y = layer(x_in)
    assert y.shape == (B, T, OUT)
    if reduce_output:
        out = y
    else:
        # the un-reduced partial sum Z_r = X_r W_r^T, without the bias
        w_local = shard(W, spec, rank, tp)
        assert_close(y, F.linear(x_local, w_local))
        summed = y.detach().clone()
        if tp > 1:
            all_reduce(summed, group)  # the "manual" all-reduce a schedule launches itself
        assert_close(layer.add_bias(summed), y_ref)
        if tp > 1:
            assert not torch.allclose(y, F.linear(x, W))  # a partial sum, not the result
        # the differentiable path a schedule takes: reduce, then add the bias
        out = layer.add_bias(reduce_from_tp(y, group))
    assert_close(out, y_ref)
    (out * dy).sum().backward()

    if input_is_parallel:
        assert_close(x_in.grad, shard(x_ref.grad, x_spec, rank, tp))
    else:  # scatter_to_tp's backward all-gathers the input gradient
        assert_close(x_in.grad, x_ref.grad)
    assert_close(layer.weight.grad, shard(ref.weight.grad, spec, rank, tp))
    assert_close(unshard(_gather_list(layer.weight.grad, group, tp), spec), ref.weight.grad)
    if bias:
        assert_close(layer.bias.grad, ref.bias.grad)
        assert layer.add_bias(torch.zeros(OUT)).equal(layer.bias.detach())
    else:
        assert layer.bias is None
        t = torch.randn(OUT)
        assert layer.add_bias(t) is t


# ---------------------------------------------------------------------------
# VocabParallelEmbedding

V_PAD, V_LOGICAL, D_EMB = 16, 10, 6   # tp=2: rank 1 half padded; tp=4: rank 3 fully padded


def _check_embedding(group, rank: int, tp: int) -> None:
    gen = torch.Generator().manual_seed(300)
    W = torch.zeros(V_PAD, D_EMB)
    W[:V_LOGICAL] = _rand(gen, V_LOGICAL, D_EMB)
    ids = torch.cat([torch.arange(V_LOGICAL),
                     torch.randint(0, V_LOGICAL, (14,), generator=gen)]).view(3, 8)
    dy = _rand(gen, 3, 8, D_EMB)

    ref = nn.Embedding(V_PAD, D_EMB)
    with torch.no_grad():
        ref.weight.copy_(W)
    y_ref = ref(ids)
    (y_ref * dy).sum().backward()

    layer = VocabParallelEmbedding(V_PAD, D_EMB, group, logical=V_LOGICAL)
    spec = layer.weight.tp_spec
    assert spec == TPSpec(0, (V_PAD, D_EMB), logical=V_LOGICAL)
    assert layer.weight.shape == (V_PAD // tp, D_EMB)
    assert layer.vocab_start == rank * (V_PAD // tp)

    # init_parameters: padded rows start at zero, and the full table is the same at any tp
    init_parameters(layer, seed=3, tp_rank=rank, tp=tp)
    full_init = unshard(_gather_list(layer.weight.detach(), group, tp), spec)
    single = VocabParallelEmbedding(V_PAD, D_EMB, None, logical=V_LOGICAL)
    init_parameters(single, seed=3, tp_rank=0, tp=1)
    assert torch.equal(full_init, single.weight.detach())
    assert torch.count_nonzero(full_init[V_LOGICAL:]) == 0
    assert torch.all(full_init[:V_LOGICAL].abs().sum(-1) > 0)

    _copy_full_into(layer.weight, W, rank, tp)
    y = layer(ids)
    assert torch.equal(y, y_ref)  # exactly one rank contributes a non-zero row per id
    (y * dy).sum().backward()
    assert_close(layer.weight.grad, shard(ref.weight.grad, spec, rank, tp))
    full_grad = unshard(_gather_list(layer.weight.grad, group, tp), spec)
    assert_close(full_grad, ref.weight.grad)
    assert torch.count_nonzero(full_grad[V_LOGICAL:]) == 0

    # reduce_output=False: the partial lookups of all ranks sum to the embedding
    part_layer = VocabParallelEmbedding(V_PAD, D_EMB, group, logical=V_LOGICAL,
                                        reduce_output=False)
    _copy_full_into(part_layer.weight, W, rank, tp)
    p = part_layer(ids)
    lo, hi = part_layer.vocab_start, part_layer.vocab_start + V_PAD // tp
    mine = (ids >= lo) & (ids < hi)
    assert torch.equal(p[mine], y_ref[mine])
    assert torch.count_nonzero(p[~mine]) == 0
    assert torch.equal(sum(_gather_list(p, group, tp)), y_ref)


# ---------------------------------------------------------------------------
# vocab-parallel cross-entropy


def _check_cross_entropy(group, rank: int, tp: int) -> None:
    gen = torch.Generator().manual_seed(400)
    B, T = 3, 7
    for ignore_index in (-100, 3):
        full = 3 * _rand(gen, B, T, V_PAD)
        # padded columns hold huge logits: if they were not masked they would dominate
        full[..., V_LOGICAL:] = 50.0
        target = torch.randint(0, V_LOGICAL, (B, T), generator=gen)
        target[0, 1] = target[2, 5] = ignore_index
        target[1, 0] = ignore_index
        w = _rand(gen, B, T)

        ref_logits = full[..., :V_LOGICAL].clone().requires_grad_()
        ref = F.cross_entropy(ref_logits.reshape(-1, V_LOGICAL), target.reshape(-1),
                              ignore_index=ignore_index, reduction="none").view(B, T)
        (ref * w).sum().backward()
        ref_grad = torch.cat([ref_logits.grad, torch.zeros(B, T, V_PAD - V_LOGICAL)], dim=-1)

        spec = TPSpec(2, (B, T, V_PAD))
        local = shard(full, spec, rank, tp).clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, target, group, V_LOGICAL,
                                            ignore_index=ignore_index)
        assert loss.shape == target.shape and loss.dtype == torch.float32
        assert_close(loss, ref)
        ignored = target == ignore_index
        assert torch.all(loss[ignored] == 0) and torch.all(loss[~ignored] > 0)
        valid = ~ignored
        mean = loss.sum() / valid.sum()
        assert_close(mean, F.cross_entropy(full[..., :V_LOGICAL].reshape(-1, V_LOGICAL),
                                           target.reshape(-1), ignore_index=ignore_index))

        (loss * w).sum().backward()
        assert_close(local.grad, shard(ref_grad, spec, rank, tp))
        full_grad = unshard(_gather_list(local.grad, group, tp), spec)
        assert torch.count_nonzero(full_grad[..., V_LOGICAL:]) == 0   # padding: zero grad
        assert torch.count_nonzero(full_grad[ignored]) == 0            # ignored rows: zero grad
        assert_close(full_grad, ref_grad)

    # low-precision logits: the loss is computed in fp32, the gradient keeps the input dtype
    full = _rand(gen, 4, V_PAD).bfloat16()
    target = torch.randint(0, V_LOGICAL, (4,), generator=gen)
    local = shard(full, TPSpec(1, (4, V_PAD)), rank, tp).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, group, V_LOGICAL)
    assert loss.dtype == torch.float32
    assert_close(loss, F.cross_entropy(full[:, :V_LOGICAL].float(), target, reduction="none"))
    loss.sum().backward()
    assert local.grad.dtype == torch.bfloat16

    # shift invariance far from 0 (a rank whose slice is all padding must not anchor the
    # log-sum-exp at 0, or exp(-1000) underflows)
    full = _rand(gen, 5, V_PAD) - 1000.0
    target = torch.randint(0, V_LOGICAL, (5,), generator=gen)
    local = shard(full, TPSpec(1, (5, V_PAD)), rank, tp)
    assert_close(vocab_parallel_cross_entropy(local, target, group, V_LOGICAL),
                 F.cross_entropy(full[:, :V_LOGICAL], target, reduction="none"))


# ---------------------------------------------------------------------------
# tp = 1: in-process, no process group


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("parts,gather_output", [(None, False), ((8, 4, 4), False), (None, True)],
                         ids=["plain", "parts", "gather"])
def test_column_parallel_linear_tp1(bias, parts, gather_output):
    _check_column(None, 0, 1, bias, parts, gather_output)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("input_is_parallel,reduce_output", [(True, True), (False, True),
                                                             (True, False)],
                         ids=["parallel-in", "full-in", "no-reduce"])
def test_row_parallel_linear_tp1(bias, input_is_parallel, reduce_output):
    _check_row(None, 0, 1, bias, input_is_parallel, reduce_output)


def test_column_gather_with_parts_refused():
    _check_column_gather_with_parts_refused(None)


def test_embedding_and_cross_entropy_tp1():
    _check_embedding(None, 0, 1)
    _check_cross_entropy(None, 0, 1)


def test_layers_refuse_indivisible_shapes():
    with pytest.raises(ValueError, match="parts"):
        ColumnParallelLinear(4, 10, None, parts=(4, 4))
    # divisibility is checked against the TP degree; with group=None tp=1 so anything goes
    assert ColumnParallelLinear(4, 7, None).weight.shape == (7, 4)
    assert RowParallelLinear(7, 4, None).weight.shape == (4, 7)


# ---------------------------------------------------------------------------
# tp = 2, 4: gloo workers. One spawn per tp runs every layer configuration.


def _layers_body(ctx):
    g, r, tp = ctx.tp_group, ctx.tp_rank, ctx.tp
    for bias in (True, False):
        for parts, gather_output in ((None, False), ((8, 4, 4), False), (None, True)):
            _check_column(g, r, tp, bias, parts, gather_output)
        for input_is_parallel, reduce_output in ((True, True), (False, True), (True, False),
                                                 (False, False)):
            _check_row(g, r, tp, bias, input_is_parallel, reduce_output)
    _check_column_gather_with_parts_refused(g)
    # each fused part must split over tp
    with pytest.raises(ValueError, match="part 1"):
        ColumnParallelLinear(4, 8 + tp + 1, g, parts=(8, tp + 1))
    with pytest.raises(ValueError, match="in_features"):
        RowParallelLinear(2 * tp + 1, 4, g)
    _check_embedding(g, r, tp)
    _check_cross_entropy(g, r, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_parallel_layers_match_unsharded(tp):
    run_distributed(_layers_body, world=tp, tp=tp)


def test_parallel_layers_tp2_with_data_parallel():
    # world 4 = dp 2 x tp 2: collectives must stay inside each TP group
    run_distributed(_layers_body, world=4, tp=2)


# ---------------------------------------------------------------------------
# shard / unshard


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_unshard_round_trip(tp):
    full = torch.randn(16, 12)
    # fused QKV-like parts along dim 0 (GQA: q wider than k, v)
    spec = TPSpec(0, (16, 12), parts=(8, 4, 4))
    shards = [shard(full, spec, r, tp) for r in range(tp)]
    for r, s in enumerate(shards):
        assert s.shape == (16 // tp, 12)
        q, k, v = full.split([8, 4, 4], dim=0)
        expect = torch.cat([q.chunk(tp)[r], k.chunk(tp)[r], v.chunk(tp)[r]])
        assert torch.equal(s, expect)
    assert torch.equal(unshard(shards, spec), full)

    # parts along dim 1 (e.g. a fused output read back as activations)
    spec1 = TPSpec(1, (16, 12), parts=(4, 8))
    shards1 = [shard(full, spec1, r, tp) for r in range(tp)]
    assert all(s.shape == (16, 12 // tp) for s in shards1)
    assert torch.equal(unshard(shards1, spec1), full)
    if tp > 1:
        # parts matter: plain concatenation of the shards is not the full tensor
        assert not torch.equal(torch.cat(shards1, dim=1), full)

    # no parts: contiguous chunks
    spec2 = TPSpec(1, (16, 12))
    shards2 = [shard(full, spec2, r, tp) for r in range(tp)]
    assert all(torch.equal(s, c) for s, c in zip(shards2, full.chunk(tp, dim=1)))
    assert torch.equal(unshard(shards2, spec2), full)

    # replicated (spec None): every rank holds the full tensor
    assert shard(full, None, 0, tp) is full
    assert unshard([full] * tp, None) is full
