"""Blocks users write: strided tensors at the collectives, in-place combines.

A user's ``partial`` may return a view (a transposed layout), and a column layer's
input may be one, which makes the gradient at the engine's cut strided too. NCCL
refuses non-contiguous tensors (gloo copies them, so CPU runs would not notice):
every worker here replaces ``dist.all_reduce`` by a wrapper that refuses them as
NCCL does, and the engine must hand the collectives contiguous buffers.

A ``combine`` that modifies its input in place is fine for plain autograd, and for
the ``oases`` engine where the tensor is not kept; under ``recompute=fine`` the
engine keeps the block input and the reduced tensor to recompute the block, so it
must refuse with an error naming the block (the recompute would be silently wrong).

Tolerances: fp32, the same operations on the same shards; only the order of a few
additions (residual gradients summed at cuts) differs: atol 1e-6 / rtol 1e-5, as
in tests/test_tp_engine_parity.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from oases.overlap.engines import OasesEngine
from oases.overlap.runner import StashModifiedError
from oases.parallel import ColumnParallelLinear, RowParallelLinear, init_parameters
from oases.parallel.block import TPBlock
from tests.support.distributed import run_distributed
from tests.support.parity import sub_batch_reference
from tests.support.toy_models import BlockStack



def _strided(t: torch.Tensor) -> torch.Tensor:
    """Same values, transposed memory layout: (B, T, d) with T the outer dimension."""
    return t.transpose(0, 1).contiguous().transpose(0, 1)


class _UserBlock(TPBlock):
    """x + W2 tanh(W1 x): ``strided`` feeds the column layer and returns the partial
    sum as strided views; ``inplace`` adds the bias to ``reduced`` in place, or the
    residual to ``x`` in place."""

    def __init__(self, d, tp_group, strided=False, inplace=None):
        super().__init__(tp_group)
        self.up = ColumnParallelLinear(d, 4 * d, tp_group)
        self.down = RowParallelLinear(4 * d, d, tp_group, reduce_output=False)
        self.strided, self.inplace = strided, inplace

    def partial(self, x):
        if self.strided:
            x = _strided(x)
        z = self.down.partial(torch.tanh(self.up(x)))
        return _strided(z) if self.strided else z

    def combine(self, x, reduced):
        if self.inplace == "reduced":
            reduced += self.down.bias
            return x + reduced
        y = self.down.add_bias(reduced)
        if self.inplace == "x":
            x += y
            return x
        return x + y


class _UserModel(BlockStack):
    """Three blocks; the first takes the model's input (the engine treats it as the
    embedding: never recomputed, its input not detached), so ``inplace`` applies from
    the second on."""

    def __init__(self, d, tp_group, strided=False, inplace=None):
        super().__init__([_UserBlock(d, tp_group, strided, inplace if i else None)
                          for i in range(3)])


def _nccl_like_all_reduce():
    """Make ``dist.all_reduce`` refuse a strided tensor, as NCCL does."""
    plain = dist.all_reduce

    def all_reduce(t, *a, **kw):
        if not t.is_contiguous():
            raise RuntimeError(f"Tensors must be contiguous (shape {tuple(t.shape)}, "
                               f"strides {t.stride()})")
        return plain(t, *a, **kw)
    dist.all_reduce = all_reduce


def _train(ctx, mode, x, t, **kw):
    model = _UserModel(8, ctx.tp_group, **kw)
    init_parameters(model, 5, ctx.tp_rank, ctx.tp)
    torch.manual_seed(100)
    if mode == "megatron":  # plain autograd on each sub-batch, as the engine splits it
        loss = sub_batch_reference(model, None, x, t, 2)
    else:
        loss = OasesEngine(ctx.tp_group, 2, mode).forward_backward(model, x, t)
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}


def _strided_body(ctx):
    _nccl_like_all_reduce()
    torch.manual_seed(0)
    x, t = torch.randn(4, 6, 8), torch.randn(4, 6, 8)
    ref_loss, ref = _train(ctx, "megatron", x, t)
    for mode in ("megatron", "none", "full", "fine"):
        for kw in (dict(strided=True), dict(inplace="reduced")):
            if mode == "fine" and "inplace" in kw:
                continue  # refused: see _inplace_body
            loss, grads = _train(ctx, mode, x, t, **kw)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7, msg=f"{mode} {kw}")
            for n in ref:
                torch.testing.assert_close(grads[n], ref[n], rtol=1e-5, atol=1e-6,
                                           msg=f"{mode} {kw} {n}")


def test_strided_partial_and_cut_gradient_and_inplace_reduced():
    run_distributed(_strided_body, world=2, tp=2)


def _inplace_body(ctx, what, needle):
    torch.manual_seed(0)
    x, t = torch.randn(4, 6, 8), torch.randn(4, 6, 8)
    # block 1 is the first whose input and reduced tensor the engine keeps
    with pytest.raises(StashModifiedError, match=rf"block 1 \(_UserBlock\) modified its {needle}"):
        _train(ctx, "fine", x, t, inplace=what)


@pytest.mark.parametrize("what,needle", [("reduced", "reduced input"), ("x", "input x")])
def test_inplace_combine_under_fine_recompute_is_refused(what, needle):
    run_distributed(_inplace_body, world=2, tp=2, args=(what, needle))


def test_all_reduce_refuses_a_strided_tensor():
    """Callers get a one-line error on every backend, not NCCL's on the cluster only."""
    from oases.parallel.comm import all_reduce

    with pytest.raises(ValueError, match=r"non-contiguous tensor \(shape \(3, 4\)"):
        all_reduce(torch.ones(4, 3).t(), object())
