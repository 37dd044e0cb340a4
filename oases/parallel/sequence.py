"""Sequence parallelism (SP): outside the matmuls, activations are split along the
sequence over the TP ranks of their block.

Activations are ``(B, T, ...)``; under SP a TP rank of a degree-t block holds the
sequence chunk ``j`` (its rank in the block's group) of ``T / t`` tokens:

    block (SP)   x_j --prologue (norm)--> h_j --all-gather(T)--> h --region--> p_r
                 p_r --reduce-scatter(T)--> r_j --combine (bias, dropout, residual)--> out_j

    op             forward                          backward
    seq_enter      all-gather along the sequence    reduce-scatter
    seq_leave      reduce-scatter along it          all-gather
    seq_gather     all-gather (to replicated)       keep own chunk
    seq_split      keep own chunk                   all-gather

The all-gather and the reduce-scatter move the bytes of the one all-reduce they
replace, in the compute dtype: under autocast the gathered region input crosses in
it (:func:`seq_enter`, :mod:`oases.parallel.wire`), as the partial sums already do;
the norms, dropout, residual stream and what recompute keeps shrink by t. A
region entered through a gathered input adds no collective of its own (its input
gradient is reduce-scattered by ``seq_enter``'s conjugate): a schedule enters it with
:data:`~oases.parallel.region.GATHERED`. Collectives move dim 0: the async helpers here
put the sequence first (:func:`seq_major`) and back (:func:`batch_major`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from oases.parallel.comm import (all_gather_to_tp, gather_from_tp, group_rank, group_size,
                                 reduce_scatter_to_tp, scatter_to_tp)
from oases.parallel.region import GATHERED, entering
from oases.parallel.wire import to_wire

SEQ_DIM = 1  # activations are (B, T, ...)


def seq_enter(x: torch.Tensor, group, wire: bool = True) -> torch.Tensor:
    """Sequence chunk -> the whole sequence, entering a TP region (backward: the input
    gradient's partial sums reduce-scattered back to chunks).

    ``wire``: the chunk crosses in the compute dtype under autocast (:func:`to_wire`).
    The region reads its input through column-parallel linears, which autocast casts to
    that dtype anyway, so the forward's values are the same bit for bit at half the
    fp32 bytes, and the backward reduce-scatters the compute dtype's gradients (the
    cast's backward returns them to ``x``'s dtype). False for a region that reads the
    chunk in its own dtype (a block whose norm is inside its ``partial``)."""
    return all_gather_to_tp(to_wire(x) if wire else x, group, dim=SEQ_DIM)


def seq_leave(p: torch.Tensor, group) -> torch.Tensor:
    """Partial sums over the whole sequence -> this rank's chunk of their sum (backward:
    all-gather)."""
    return reduce_scatter_to_tp(p, group, dim=SEQ_DIM)


def seq_gather(x: torch.Tensor, group) -> torch.Tensor:
    """Sequence chunk -> the whole sequence, replicated (a pipeline stage's output)."""
    return gather_from_tp(x, group, dim=SEQ_DIM)


def seq_split(x: torch.Tensor, group) -> torch.Tensor:
    """Replicated whole sequence -> this rank's chunk (a pipeline stage's input)."""
    return scatter_to_tp(x, group, dim=SEQ_DIM)


def seq_part(module: nn.Module) -> tuple[int, int]:
    """(chunk index, chunks) of the sequence a module's activations hold: (rank in its TP
    group, degree) under SP, else (0, 1)."""
    if not getattr(module, "sequence_parallel", False):
        return 0, 1
    return group_rank(module.tp_group), group_size(module.tp_group)


def seq_major(x: torch.Tensor) -> torch.Tensor:
    """(B, T, ...) -> (T, B, ...), contiguous: the layout a dim-0 collective moves."""
    return x.movedim(SEQ_DIM, 0).contiguous()


def batch_major(x: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`seq_major`, contiguous (the layers' layout)."""
    return x.movedim(0, SEQ_DIM).contiguous()


def part_dropout(dropout: nn.Module, y: torch.Tensor, rows: tuple[int, int] = (0, 1),
                 seq: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """``dropout(y)`` for ``y`` part ``rows = (g, k)`` of the batch and chunk ``seq =
    (j, n)`` of the sequence of a (k B, n T, ...) whole: with the whole's mask, drawn from
    the generator as an unsplit run draws it, of which this part is kept (a copy, so that
    what backward keeps is the part only). A whole ``y``, evaluation or p = 0: plain
    ``dropout(y)``."""
    (g, k), (j, n) = rows, seq
    if (k == 1 and n == 1) or not dropout.training or dropout.p == 0.0:
        return dropout(y)
    B, T = y.shape[0], y.shape[SEQ_DIM]
    whole = y.new_ones((k * B, n * T, *y.shape[2:]))             # (k B, n T, ...)
    return y * dropout(whole).narrow(0, g * B, B).narrow(SEQ_DIM, j * T, T).clone()


def gathered_region(region, x: torch.Tensor, group, wire: bool = True) -> torch.Tensor:
    """``region`` on the whole sequence all-gathered from the chunks ``x``, entered
    through :data:`~oases.parallel.region.GATHERED` (the all-gather's backward
    reduce-scatters the input gradient; the region adds no collective of its own).
    ``wire``: as :func:`seq_enter`'s."""
    h = seq_enter(x, group, wire)
    with entering(GATHERED):
        return region(h)


def set_sequence_parallel(module: nn.Module, on: bool) -> None:
    """Turn SP on or off for every block and parallel layer in ``module`` (whatever has a
    ``sequence_parallel`` class attribute: oases.parallel.block.TPBlock, the layers of
    oases.parallel.layers, the model)."""
    for m in module.modules():
        if hasattr(type(m), "sequence_parallel"):
            m.sequence_parallel = on

