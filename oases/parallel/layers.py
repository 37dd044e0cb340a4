"""Megatron-style tensor-parallel layers. Public API: subclass or combine them.

A column-parallel layer followed by a row-parallel one needs one all-reduce in
forward (after the row layer) and one in backward (the input gradient of the
column layer):

    x ──copy_to_tp──> [ColumnParallelLinear: Y_r = x A_r] ──act──> [RowParallelLinear: Z_r = Y_r B_r] ──all-reduce──> Z
        (bwd: all-reduce)                                                                   (bwd: identity)

``RowParallelLinear(reduce_output=False)`` returns the un-reduced partial sum
Z_r, so a schedule can launch the all-reduce itself (asynchronously) and add
the bias afterwards with :meth:`RowParallelLinear.add_bias`.

``sequence_parallel`` (a layer's flag; the model sets it on every layer and block,
oases.parallel.sequence.set_sequence_parallel): the column layer's input is a sequence
chunk, all-gathered before the matmul (backward: reduce-scatter), unless a schedule
already gathered it (it entered the region through ``GATHERED``); the row layer and the
embedding reduce-scatter their output along the sequence instead of all-reducing it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from oases.parallel.comm import (column_linear, copy_to_tp, gather_from_tp, group_rank,
                                 group_size, reduce_from_tp, scatter_to_tp)
from oases.parallel.region import GATHERED, entered_region
from oases.parallel.sequence import seq_enter, seq_leave
from oases.parallel.sharding import TPSpec, chunk_of, divide, local_parts, set_spec


def _set_coords(layer: nn.Module, group) -> None:
    """Record (rank, size) of the group each sharded parameter is split over."""
    for p in layer.parameters(recurse=False):
        p.tp_coords = (group_rank(group), group_size(group))


def _param(old: Optional[nn.Parameter], shape: tuple, kw: dict, spec: Optional[TPSpec],
           init: tuple) -> nn.Parameter:
    """A parameter of this rank's ``shape``: new (``kw``: device and dtype) with its spec
    and init rule, or ``old`` resized, its device, dtype and tags kept. Its values are
    not: a layer is sharded before its parameters are initialised."""
    if old is None:
        return set_spec(nn.Parameter(torch.empty(shape, **kw)), spec, init)
    if tuple(old.shape) == tuple(shape):
        return old
    new = nn.Parameter(torch.empty(shape, device=old.device, dtype=old.dtype),
                       old.requires_grad)
    new.__dict__.update(old.__dict__)
    return new


class ParallelLayer(nn.Module):
    """A layer whose parameters are split over a TP group. :meth:`shard` splits it over
    another group (:meth:`oases.parallel.block.TPBlock.shard` calls it on every such
    layer of a block): how :func:`oases.models.parallelize.parallelize` applies a plan's
    degrees to a model built unsharded."""

    tp_group = None
    tp = 1
    # a WeightGradStore (oases.parallel.wgrad): the linear layers' weight gradients may
    # be deferred to a zero-bubble pipeline's W actions (None: computed in backward)
    wgrad = None

    def shard(self, tp_group) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class ColumnParallelLinear(ParallelLayer):
    """Y = X A^T + b with A split along its output dimension.

    | tensor  | full        | on each of tp ranks                |
    |---------|-------------|------------------------------------|
    | input   | (..., in)   | (..., in), replicated              |
    | weight  | (out, in)   | (out/tp, in)                       |
    | bias    | (out,)      | (out/tp,)                          |
    | output  | (..., out)  | (..., out/tp), or full if gathered |

    ``parts`` fuses several projections in one matmul (QKV, SwiGLU gate+up): the
    full output is ``cat(parts)`` and each part is sharded on its own, so a rank's
    local output is ``cat(part_r for part in parts)``. ``units`` (per part, e.g. its
    attention heads) lets a part with fewer units than ranks be replicated instead
    (oases.parallel.sharding.chunk_of): the ranks sharing a unit hold the same rows,
    and their gradients must be summed over them (oases.dp.replicas).
    """

    sequence_parallel = False

    def __init__(self, in_features: int, out_features: int, tp_group=None, bias: bool = True,
                 gather_output: bool = False, parts: Optional[Sequence[int]] = None,
                 init_std: float = 0.02, device=None, dtype=None,
                 units: Optional[Sequence[int]] = None, sequence_parallel: bool = False,
                 logical: Optional[int] = None) -> None:
        """``logical``: the rows that are real (a vocabulary padded to ``out_features``:
        the padding rows start at zero)."""
        super().__init__()
        self.sequence_parallel = sequence_parallel
        if parts is not None and sum(parts) != out_features:
            raise ValueError(f"parts {tuple(parts)} do not add up to out_features={out_features}")
        self.parts = tuple(parts) if parts else None
        self.units = tuple(units) if units else None
        self.spec = TPSpec(0, (out_features, in_features), self.parts, units=self.units,
                           logical=logical)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        self.init_std, self.has_bias, self.kw = init_std, bias, dict(device=device, dtype=dtype)
        self.register_parameter("weight", None)
        self.register_parameter("bias", None)
        self.shard(tp_group)

    def shard(self, tp_group) -> None:
        tp, spec = group_size(tp_group), self.spec
        for i, p in enumerate(self.parts or (self.out_features,)):
            n = chunk_of(spec, i, 0, tp)[1]  # tp, or the part's units when fewer
            divide(p, n, f"ColumnParallelLinear out_features part {i}")
            if tp % n:
                raise ValueError(f"ColumnParallelLinear part {i} has {n} units, which do not "
                                 f"divide tp={tp}: it can be neither split nor replicated")
        self.tp_group, self.tp = tp_group, tp
        self._local_parts = tuple(local_parts(spec, tp))
        self.out_per_rank = sum(self._local_parts)
        self.weight = _param(self.weight, (self.out_per_rank, self.in_features), self.kw, spec,
                             ("normal", self.init_std))
        if self.has_bias:
            self.bias = _param(self.bias, (self.out_per_rank,), self.kw,
                               TPSpec(0, (self.out_features,), self.parts, units=self.units),
                               ("zeros",))
        _set_coords(self, tp_group)

    @property
    def local_parts(self) -> tuple:
        """Sizes of the fused parts in this rank's output."""
        return self._local_parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the input enters the TP region: the entered region entry decides who all-reduces
        # dX (autograd, overlapped with dW; or the schedule, at a cut it records)
        if self.sequence_parallel and entered_region() is not GATHERED and self.tp > 1:
            x = seq_enter(x, self.tp_group)  # (B, T/tp, in) -> (B, T, in)
            y = self._linear(x, GATHERED)
        elif self.wgrad is not None:  # dW deferrable: the region entered, then the matmul
            y = self.wgrad.linear(copy_to_tp(x, self.tp_group), self.weight, self.bias)
        else:
            y = column_linear(x, self.weight, self.bias, self.tp_group)  # (..., out/tp)
        if self.gather_output:
            if self.parts or self.weight.tp_spec.units:
                raise ValueError("gather_output with fused or replicated parts would "
                                 "interleave them")
            y = gather_from_tp(y, self.tp_group, dim=-1)
        return y

    def _linear(self, x: torch.Tensor, entry) -> torch.Tensor:
        if self.wgrad is not None:
            return self.wgrad.linear(entry.copy(x, self.tp_group), self.weight, self.bias)
        return entry.linear(x, self.weight, self.bias, self.tp_group)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp}, "
                f"parts={self.parts}, bias={self.bias is not None}")


class RowParallelLinear(ParallelLayer):
    """Y = X A^T + b with A split along its input dimension.

    | tensor  | full        | on each of tp ranks                          |
    |---------|-------------|----------------------------------------------|
    | input   | (..., in)   | (..., in/tp) (scattered if not parallel)     |
    | weight  | (out, in)   | (out, in/tp)                                 |
    | bias    | (out,)      | (out,), replicated; added after the reduce   |
    | output  | (..., out)  | (..., out) reduced, or the partial sum Z_r   |
    """

    sequence_parallel = False  # reduce-scatter the output along the sequence

    def __init__(self, in_features: int, out_features: int, tp_group=None, bias: bool = True,
                 input_is_parallel: bool = True, reduce_output: bool = True,
                 init_std: float = 0.02, device=None, dtype=None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        self.reduce_output = reduce_output
        self.init_std, self.kw = init_std, dict(device=device, dtype=dtype)
        self.register_parameter("weight", None)
        if bias:  # replicated: the same at every degree
            self.bias = set_spec(nn.Parameter(torch.empty(out_features, **self.kw)), None,
                                 ("zeros",))
        else:
            self.register_parameter("bias", None)
        self.shard(tp_group)

    def shard(self, tp_group) -> None:
        tp = group_size(tp_group)
        self.in_per_rank = divide(self.in_features, tp, "RowParallelLinear in_features")
        self.tp_group, self.tp = tp_group, tp
        self.weight = _param(self.weight, (self.out_features, self.in_per_rank), self.kw,
                             TPSpec(1, (self.out_features, self.in_features)),
                             ("normal", self.init_std))
        _set_coords(self, tp_group)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's un-reduced partial sum, without the bias."""
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.tp_group, dim=-1)
        if self.wgrad is not None:  # dW deferrable (zero-bubble pipelines)
            return self.wgrad.linear(x, self.weight)
        return F.linear(x, self.weight)

    def add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.partial(x)
        if not self.reduce_output:
            return y
        if self.sequence_parallel:
            return self.add_bias(seq_leave(y, self.tp_group))  # (B, T/tp, out)
        return self.add_bias(reduce_from_tp(y, self.tp_group))

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp}, "
                f"reduce_output={self.reduce_output}, bias={self.bias is not None}")


class VocabParallelEmbedding(ParallelLayer):
    """Embedding table split along the vocabulary.

    | tensor  | full            | on each of tp ranks                         |
    |---------|-----------------|---------------------------------------------|
    | ids     | (...)           | (...), replicated                           |
    | weight  | (V_pad, d)      | (V_pad/tp, d): rows [r*V_pad/tp, (r+1)*...) |
    | output  | (..., d)        | (..., d) after the all-reduce (or partial)  |

    Ids outside a rank's rows look up zeros there; the all-reduce sums the one
    non-zero row. ``num_embeddings`` is the padded size; ``logical`` the real
    vocabulary (padded rows start at zero).
    """

    sequence_parallel = False  # reduce-scatter the output along the sequence

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group=None,
                 logical: Optional[int] = None, reduce_output: bool = True,
                 init_std: float = 0.02, device=None, dtype=None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.reduce_output = reduce_output
        self.logical, self.init_std = logical, init_std
        self.kw = dict(device=device, dtype=dtype)
        self.register_parameter("weight", None)
        self.shard(tp_group)

    def shard(self, tp_group) -> None:
        tp = group_size(tp_group)
        self.per_rank = divide(self.num_embeddings, tp, "VocabParallelEmbedding num_embeddings")
        self.tp_group, self.tp = tp_group, tp
        self.vocab_start = group_rank(tp_group) * self.per_rank
        self.weight = _param(self.weight, (self.per_rank, self.embedding_dim), self.kw,
                             TPSpec(0, (self.num_embeddings, self.embedding_dim),
                                    logical=self.logical), ("normal", self.init_std))
        _set_coords(self, tp_group)

    def partial(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.per_rank)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        return F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y = self.partial(ids)
        if not self.reduce_output:
            return y
        return seq_leave(y, self.tp_group) if self.sequence_parallel else \
            reduce_from_tp(y, self.tp_group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp}"
