"""Toy models of the engine protocol: a stack of residual TP blocks with an MSE loss
(blocks(), loss_from_hidden()), and a BlockParams hook that records what an engine asks."""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from oases.parallel import ColumnParallelLinear, RowParallelLinear, init_parameters
from oases.parallel.block import TPBlock
from oases.parallel.engine import WHOLE


class ToyBlock(TPBlock):
    def __init__(self, d, tp_group=None):
        super().__init__(tp_group)
        self.up = ColumnParallelLinear(d, 2 * d, tp_group)
        self.down = RowParallelLinear(2 * d, d, tp_group, reduce_output=False)

    def partial(self, x):
        return self.down.partial(F.gelu(self.up(x)))

    def combine(self, x, reduced):
        return x + self.down.add_bias(reduced)


class BlockStack(nn.Module):
    """The least model an engine runs: ``blocks`` (the TP blocks of ``self.stack``) and an
    MSE ``loss_from_hidden``; the forward runs the blocks in turn."""

    def __init__(self, blocks) -> None:
        super().__init__()
        self.stack = nn.ModuleList(blocks)

    def blocks(self):
        return list(self.stack)

    def loss_from_hidden(self, x, target):
        return F.mse_loss(x, target)

    def forward(self, x, target=None):
        for b in self.stack:
            x = b(x)
        return x if target is None else self.loss_from_hidden(x, target)


class ToyModel(BlockStack):
    def __init__(self, d=8, n=3, tp_group=None, tp_rank=0, tp=1):
        super().__init__([ToyBlock(d, tp_group) for _ in range(n)])
        init_parameters(self, seed=5, tp_rank=tp_rank, tp=tp)


class RecordedParams:
    """A BlockParams hook that records what the engine asks of it."""

    def __init__(self):
        self.calls: list[tuple[int, object]] = []
        self.passes = 0

    def use(self, block, prefetch=None):
        self.calls.append((block, prefetch))

    def two_passes(self):
        self.passes += 1
        return WHOLE.two_passes()
