"""Tensor-parallel building blocks: groups, communication, layers, loss, RNG."""

from oases.parallel.comm import (CommCounter, all_gather_to_tp, copy_to_tp, gather_from_tp,
                                 reduce_from_tp, reduce_scatter_to_tp, scatter_to_tp)
from oases.parallel.groups import ParallelContext, init_distributed
from oases.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from oases.parallel.loss import vocab_parallel_cross_entropy
from oases.parallel.random import TPRNGTracker
from oases.parallel.sharding import TPSpec, init_parameters, shard, unshard

__all__ = [
    "CommCounter", "all_gather_to_tp", "copy_to_tp", "gather_from_tp", "reduce_from_tp",
    "reduce_scatter_to_tp", "scatter_to_tp", "ParallelContext", "init_distributed",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy", "TPRNGTracker", "TPSpec", "init_parameters", "shard",
    "unshard",
]
