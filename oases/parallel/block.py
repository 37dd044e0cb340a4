"""The block protocol: the unit every schedule works on.

A *block* is a computation that ends in one TP all-reduce:

    out = block.combine(x, all_reduce(block.partial(x)))

* ``partial(x)`` runs everything up to the reduction and returns this rank's
  partial sum (typically a ``RowParallelLinear.partial`` or a vocab-parallel
  lookup). It must not issue forward collectives of its own.
* ``combine(x, reduced)`` runs what follows the reduction on replicated data
  (bias, dropout, residual add). It must not communicate.

``partial`` may be split in two: ``prologue(x)``, the sequence-local work before the
TP region (a pre-norm), and ``region(h)``, from the region's input to the partial sum,
with ``partial(x) == region(prologue(x))``. A block that defines ``partial`` itself is
taken whole, with an identity prologue (:meth:`TPBlock.around_gather`).

``partial_steps(x)`` and ``region_steps(h)`` are the same computations as programs
(:mod:`oases.parallel.program`): a block whose partial waits for transfers of its own
(ring attention's) yields at each wait, so that the ``oases`` engine runs other
sub-batches meanwhile; by default each is the plain method, in one piece.

``forward`` is the plain (blocking) path. A schedule that wants to hide the
all-reduce calls ``partial``, launches the reduction itself, runs other work
and calls ``combine`` when the reduction is done. A model is

    embedding block -> [blocks] -> final norm -> vocab-parallel head -> loss

and exposes the flat list through ``model.blocks()``. Writing a new block means
subclassing :class:`TPBlock` and building ``partial`` from the parallel layers
(see docs/custom-blocks.md).

Sequence parallelism (``sequence_parallel``, :mod:`oases.parallel.sequence`): the
block's input and output are sequence chunks, and the all-reduce becomes an all-gather
of the prologue's output and a reduce-scatter of the partial sum:

    out_j = combine(x_j, reduce_scatter(region(all_gather(prologue(x_j)))))

``combine`` then sees this rank's chunk of the sequence (:func:`~oases.parallel.sequence.
seq_part` says which); a block whose input is token ids (the embedding) runs
``partial`` on the whole sequence and has no all-gather.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from oases.parallel.comm import group_size, reduce_from_tp
from oases.parallel.layers import ParallelLayer
from oases.parallel.program import Steps, done
from oases.parallel.sequence import gathered_region, seq_leave


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class TPBlock(nn.Module):
    sequence_parallel = False  # oases.parallel.sequence.set_sequence_parallel

    def __init__(self, tp_group=None) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.degree = group_size(tp_group)  # TP degree this block runs at

    def shard(self, tp_group) -> None:
        """Run this block at the degree of ``tp_group``: every parallel layer in it is split
        over that group (:meth:`~oases.parallel.layers.ParallelLayer.shard`), before the
        parameters are initialised. A block that derives sizes from its degree (local
        heads) overrides it and calls this one."""
        self.tp_group, self.degree = tp_group, group_size(tp_group)
        for m in self.modules():
            if isinstance(m, ParallelLayer):
                m.shard(tp_group)

    def prologue(self, x: torch.Tensor) -> torch.Tensor:
        """The sequence-local work before the TP region (default: none)."""
        return x

    def region(self, h: torch.Tensor) -> torch.Tensor:
        """From the TP region's input (the prologue's output) to the partial sum."""
        return self.partial(h)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """Up to the reduction: ``region(prologue(x))`` unless a block defines it."""
        if type(self).region is TPBlock.region:  # neither is defined: abstract
            raise NotImplementedError(f"{type(self).__name__} defines neither partial nor "
                                      f"region")
        return self.region(self.prologue(x))

    def partial_steps(self, x: torch.Tensor) -> Steps:
        """:meth:`partial` as a program (default: the method, in one piece)."""
        return done(self.partial(x))

    def region_steps(self, h: torch.Tensor) -> Steps:
        """:meth:`region` as a program (default: the method, in one piece)."""
        return done(self.region(h))

    def combine(self, x: torch.Tensor, reduced: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def around_gather(self) -> tuple:
        """(prologue, region) as a schedule runs them around the all-gather of sequence
        parallelism: the block's own, or (identity, partial) for a block that defines
        ``partial`` itself (its norm, if any, then runs on the whole sequence)."""
        if type(self).partial is not TPBlock.partial:
            return _identity, self.partial
        return self.prologue, self.region

    def around_gather_steps(self) -> tuple:
        """:meth:`around_gather` with the region as a program (:meth:`region_steps`, or
        :meth:`partial_steps` for a block that defines ``partial`` itself)."""
        if type(self).partial is not TPBlock.partial:
            return _identity, self.partial_steps
        return self.prologue, self.region_steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return self.combine(x, reduce_from_tp(self.partial(x), self.tp_group))
        if x.is_floating_point():  # an activation's sequence chunk
            prologue, region = self.around_gather()
            h = prologue(x)  # x itself: the region reads the chunk in its own dtype
            p = gathered_region(region, h, self.tp_group, wire=h is not x)
        else:  # token ids, whole on every rank
            p = self.partial(x)
        return self.combine(x, seq_leave(p, self.tp_group))
