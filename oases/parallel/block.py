"""The block protocol: the unit every schedule works on.

A *block* is a computation that ends in one TP all-reduce:

    out = block.combine(x, all_reduce(block.partial(x)))

* ``partial(x)`` runs everything up to the reduction and returns this rank's
  partial sum (typically a ``RowParallelLinear.partial`` or a vocab-parallel
  lookup). It must not issue forward collectives of its own.
* ``combine(x, reduced)`` runs what follows the reduction on replicated data
  (bias, dropout, residual add). It must not communicate.

``forward`` is the plain (blocking) path. A schedule that wants to hide the
all-reduce calls ``partial``, launches the reduction itself, runs other work
and calls ``combine`` when the reduction is done. A model is

    embedding block -> [blocks] -> final norm -> vocab-parallel head -> loss

and exposes the flat list through ``model.blocks()``. Writing a new block means
subclassing :class:`TPBlock` and building ``partial`` from the parallel layers
(see docs/custom-blocks.md).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from oases.parallel.comm import group_size, reduce_from_tp


class TPBlock(nn.Module):
    def __init__(self, tp_group=None) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.degree = group_size(tp_group)  # TP degree this block runs at

    def partial(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def combine(self, x: torch.Tensor, reduced: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.combine(x, reduce_from_tp(self.partial(x), self.tp_group))
