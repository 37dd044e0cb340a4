"""Tensor-parallel building blocks: groups, communication, layers, loss, RNG.

The names below load their module on first use (PEP 562), so that a torch-free part of
the package (:mod:`oases.parallel.nccl_env`, which the launcher reads) imports without
torch.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names, for readers and type checkers; loaded lazily below
    from oases.parallel.comm import (CommCounter, all_gather_to_tp, copy_to_tp,
                                     gather_from_tp, reduce_from_tp, reduce_scatter_to_tp,
                                     scatter_to_tp)
    from oases.parallel.groups import ParallelContext, init_distributed
    from oases.parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                       VocabParallelEmbedding)
    from oases.parallel.loss import vocab_parallel_cross_entropy
    from oases.parallel.random import TPRNGTracker
    from oases.parallel.sharding import TPSpec, init_parameters, shard, unshard

_HOME = {
    "CommCounter": "comm", "all_gather_to_tp": "comm", "copy_to_tp": "comm",
    "gather_from_tp": "comm", "reduce_from_tp": "comm", "reduce_scatter_to_tp": "comm",
    "scatter_to_tp": "comm", "ParallelContext": "groups", "init_distributed": "groups",
    "ColumnParallelLinear": "layers", "RowParallelLinear": "layers",
    "VocabParallelEmbedding": "layers", "vocab_parallel_cross_entropy": "loss",
    "TPRNGTracker": "random", "TPSpec": "sharding", "init_parameters": "sharding",
    "shard": "sharding", "unshard": "sharding",
}
__all__ = [
    "CommCounter", "all_gather_to_tp", "copy_to_tp", "gather_from_tp", "reduce_from_tp",
    "reduce_scatter_to_tp", "scatter_to_tp", "ParallelContext", "init_distributed",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy", "TPRNGTracker", "TPSpec", "init_parameters", "shard",
    "unshard",
]
assert set(__all__) == set(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'oases.parallel' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"oases.parallel.{_HOME[name]}"), name)
    globals()[name] = value
    return value
