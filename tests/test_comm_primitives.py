"""The TP communication primitives (``oases.parallel.comm``) on 2 and 4 ranks and without a
group: each conjugate pair's forward and backward against what the collective must give,
values compared exactly (pure data movement) or to fp32 rounding (sums), and the
collectives each call issues counted.

tp=2/4 run in gloo worker processes (tests/support/distributed.py).
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from oases.parallel.comm import (CommCounter, all_gather_to_tp, copy_to_tp, gather_from_tp,
                                 reduce_from_tp, reduce_scatter_to_tp, scatter_to_tp)
from tests.support.distributed import run_distributed

# ---------------------------------------------------------------------------
# communication primitives


def _rank_tensor(global_rank: int, shape, salt: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1000 * salt + global_rank))


def _comm_body(ctx):
    g, r, tp = ctx.tp_group, ctx.tp_rank, ctx.tp
    members = [ctx.dp_rank * tp + i for i in range(tp)]   # global ranks of this TP group
    assert members[r] == ctx.rank
    outer = CommCounter()
    with outer:
        for dim in (0, -1):
            big = (4, 3, 8)                  # splittable over tp<=4 along dims 0 and -1
            small = list(big)
            small[dim] //= tp                # one rank's chunk of `big`
            salt = 10 * (dim % 3)

            # copy_to_tp: identity forward, all-reduce backward
            xs = [_rank_tensor(m, big, salt + 1) for m in members]
            gs = [_rank_tensor(m, big, salt + 2) for m in members]
            x = xs[r].clone().requires_grad_()
            with CommCounter() as c:
                y = copy_to_tp(x, g)
                assert torch.equal(y, xs[r])
                assert sum(c.counts.values()) == 0
                y.backward(gs[r])
            assert dict(c.counts) == {"all_reduce": 1}
            assert c.bytes["all_reduce"] == gs[r].numel() * 4
            assert_close(x.grad, sum(gs))

            # reduce_from_tp: all-reduce forward, identity backward
            x = xs[r].clone().requires_grad_()
            with CommCounter() as c:
                y = reduce_from_tp(x, g)
                assert_close(y, sum(xs))
                assert torch.equal(x.detach(), xs[r])  # the input is not reduced in place
                y.backward(gs[r])
            assert dict(c.counts) == {"all_reduce": 1}
            assert torch.equal(x.grad, gs[r])

            # gather_from_tp: all-gather forward, keep own chunk backward
            xs_small = [_rank_tensor(m, small, salt + 3) for m in members]
            x = xs_small[r].clone().requires_grad_()
            with CommCounter() as c:
                y = gather_from_tp(x, g, dim=dim)
                assert torch.equal(y, torch.cat(xs_small, dim=dim))
                y.backward(gs[r])
            assert dict(c.counts) == {"all_gather": 1}
            assert c.bytes["all_gather"] == x.numel() * 4
            assert torch.equal(x.grad, gs[r].chunk(tp, dim=dim)[r])

            # scatter_to_tp: keep own chunk forward, all-gather backward
            gs_small = [_rank_tensor(m, small, salt + 4) for m in members]
            x = xs[0].clone().requires_grad_()   # replicated input
            with CommCounter() as c:
                y = scatter_to_tp(x, g, dim=dim)
                assert torch.equal(y, xs[0].chunk(tp, dim=dim)[r])
                assert sum(c.counts.values()) == 0
                y.backward(gs_small[r])
            assert dict(c.counts) == {"all_gather": 1}
            assert torch.equal(x.grad, torch.cat(gs_small, dim=dim))

            # reduce_scatter_to_tp: reduce-scatter forward, all-gather backward
            x = xs[r].clone().requires_grad_()
            with CommCounter() as c:
                y = reduce_scatter_to_tp(x, g, dim=dim)
                assert y.shape == tuple(small)
                assert_close(y, sum(xs).chunk(tp, dim=dim)[r])
                y.backward(gs_small[r])
            assert dict(c.counts) == {"reduce_scatter": 1, "all_gather": 1}
            assert c.bytes["reduce_scatter"] == x.numel() * 4
            assert torch.equal(x.grad, torch.cat(gs_small, dim=dim))

            # all_gather_to_tp: all-gather forward, reduce-scatter backward
            x = xs_small[r].clone().requires_grad_()
            with CommCounter() as c:
                y = all_gather_to_tp(x, g, dim=dim)
                assert torch.equal(y, torch.cat(xs_small, dim=dim))
                y.backward(gs[r])
            assert dict(c.counts) == {"all_gather": 1, "reduce_scatter": 1}
            assert_close(x.grad, sum(gs).chunk(tp, dim=dim)[r])

    # the enclosing counter saw every collective of the nested ones: per dim,
    # all_reduce 2, all_gather 4 (gather fwd, scatter bwd, reduce-scatter bwd, all-gather fwd),
    # reduce_scatter 2
    assert dict(outer.counts) == {"all_reduce": 4, "all_gather": 8, "reduce_scatter": 4}
    # a counter records nothing once its block has ended
    reduce_from_tp(torch.ones(2), g)
    assert sum(outer.counts.values()) == 16

    # an indivisible split is refused, not silently truncated
    with pytest.raises(ValueError, match="does not split"):
        scatter_to_tp(torch.ones(3, tp + 1), g, dim=-1)
    with pytest.raises(ValueError, match="does not split"):
        reduce_scatter_to_tp(torch.ones(tp + 1, 3), g, dim=0)


@pytest.mark.parametrize("world,tp", [(2, 2), (4, 4), (4, 2)], ids=["tp2", "tp4", "dp2xtp2"])
def test_comm_primitives(world, tp):
    run_distributed(_comm_body, world=world, tp=tp)


def test_comm_primitives_are_identities_without_group():
    x = torch.randn(4, 6, requires_grad=True)
    with CommCounter() as c:
        for op in (copy_to_tp, reduce_from_tp):
            assert op(x, None) is x
        for op in (gather_from_tp, scatter_to_tp, reduce_scatter_to_tp, all_gather_to_tp):
            for dim in (0, -1):
                assert op(x, None, dim=dim) is x
    assert sum(c.counts.values()) == 0 and sum(c.bytes.values()) == 0


