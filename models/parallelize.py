"""Parallelism is applied to a model from outside (torchtitan's ``parallelize_llama``): a
:class:`~oases.models.common.CausalLM` is architecture only, built whole and unsharded on
the meta device; :func:`parallelize` then applies this rank's :class:`Parallelism` (its
pipeline stage, TP groups and per-block degrees, recompute, sequence parallelism, compile
and the parameter tags the DP reduction reads); :func:`materialize` makes the parameters
on the device, and :func:`build` does the three and initialises them.

    model = Llama(cfg, padded_vocab)            # on torch.device("meta")
    parallelize(model, Parallelism(tp_group=g, stage=(0, 16), recompute="selective"))
    materialize(model, device)
    init_parameters(model, seed, rank, size)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn as nn

from oases.errors import ConfigError
from oases.models.common import CausalLM
from oases.parallel.comm import group_rank, group_size
from oases.parallel.compile import compile_blocks
from oases.parallel.layers import ColumnParallelLinear, RowParallelLinear
from oases.parallel.random import TPRNGTracker
from oases.parallel.sharding import init_parameters
from oases.parallel.wgrad import WeightGradStore

__all__ = ["Parallelism", "build", "materialize", "parallelize"]


@dataclass(frozen=True)
class Parallelism:
    """How this rank runs its model.

    ``tp_group``: the TP group (None: one rank). ``degrees``: a TP degree per block
    (attn, mlp of each layer of the stage, in order; :mod:`oases.parallel.reshard`) with
    ``degree_groups`` holding their groups (None: every block on ``tp_group``).
    ``stage``: the layers [a, b) of this rank's pipeline stage (None: all). ``recompute``:
    what the model recomputes itself ("full" per layer, "selective" the attention core;
    the oases engine's own recompute is not the model's). ``compile``: False, True or
    "strict" (:func:`oases.parallel.compile.compile_blocks`). ``defer_weight_grads``: the
    blocks' linear layers compute through one :class:`~oases.parallel.wgrad.WeightGradStore`
    (``model.wgrad``), so a zero-bubble pipeline's B defers their dW to its W.
    ``chunks`` (interleaved-1f1b, instead of ``stage``): the layer ranges of this rank's
    virtual stages; the model keeps them all and ``model.chunks`` holds a view per range
    (:meth:`~oases.models.common.CausalLM.chunk`), whose layers draw their dropout from
    that chunk's tracker in ``chunk_trackers`` (a virtual stage's random stream is the
    one a stage of those layers would have at pp x pp_virtual).

    ``cp_group``: context parallelism (None: cp 1, the model unchanged). Its ranks are
    those with this rank's TP rank (and stage); each computes its head-tail tokens of
    every row (:func:`oases.parallel.cp_chunks.shard_sequence` of the ids and targets,
    dim 1), at their global positions, while the documents in the model's slot are the
    whole rows'; attention runs the ring (:mod:`oases.parallel.ring_attention`) over
    this group, and the loss is the mean over this rank's counted targets
    (docs/context-parallel.md). :func:`parallelize` refuses what the ring cannot do."""
    tp_group: Optional[object] = None
    tracker: Optional[TPRNGTracker] = None
    recompute: str = "none"
    degrees: Optional[tuple[int, ...]] = None
    degree_groups: Optional[object] = None
    stage: Optional[tuple[int, int]] = None
    sequence_parallel: bool = False
    compile: Union[bool, str] = False
    defer_weight_grads: bool = False  # the blocks' linear dW left to W actions (zb-h1)
    chunks: Optional[tuple[tuple[int, int], ...]] = None
    chunk_trackers: Optional[tuple[TPRNGTracker, ...]] = None
    cp_group: Optional[object] = None
    cp_overlap: bool = True  # the ring's next receive runs behind this step's attention
    # an oases.parallel.timing.IntervalTimer every ring wait adds to (None: untimed)
    cp_clock: Optional[object] = None


def parallelize(model: CausalLM, par: Parallelism) -> CausalLM:
    """Apply ``par`` to ``model`` (built unsharded, not yet initialised: sharding keeps no
    values) in place; returns it. Raises ValueError for a plan the model cannot take."""
    if par.stage is not None and par.chunks is not None:
        raise ValueError("a model is one stage or several chunks, not both")
    cp = group_size(par.cp_group)
    if cp > 1:
        _refuse_under_cp(model, par, cp)
    if par.stage is not None:
        model.keep_layers(*par.stage)
    if par.chunks is not None:
        if par.degrees is not None:
            raise ValueError("per-block TP degrees are for one stage's layers, not chunks")
        model.keep_chunks(list(par.chunks))
    a, b = model.layer_range
    degrees = list(par.degrees) if par.degrees is not None else None
    if degrees is not None and len(degrees) != 2 * (b - a):
        raise ValueError(f"{len(degrees)} block degrees for {2 * (b - a)} blocks")
    tp = group_size(par.tp_group)
    model.tp_group, model.tracker, model.recompute = par.tp_group, par.tracker, par.recompute
    model.home_degree = tp
    model.resharder = par.degree_groups if degrees is not None and set(degrees) != {tp} else None
    rs = model.resharder  # a block at a lower degree computes a piece of the documents' rows
    model.documents.home = tp
    model.documents.pieces = None if rs is None else (lambda t: rs.piece(tp, t))
    model.cp_group = par.cp_group
    model.cp_clock = par.cp_clock
    model.documents.cp = (cp, group_rank(par.cp_group))

    def group(j: int):
        return par.tp_group if model.resharder is None else par.degree_groups.sub[degrees[j]]

    if model.is_first:
        model.embed.shard(par.tp_group)
    elif model.embed is not None:  # the last stage's copy of a tied table
        model.embed.wte.shard(par.tp_group)
    for i, layer in enumerate(model.layers):
        layer.attn.shard(group(2 * i))
        layer.mlp.shard(group(2 * i + 1))
        layer.resharder = model.resharder
        layer.attn.tracker = par.tracker
        layer.attn.selective = par.recompute == "selective"
        layer.attn.cp_group = par.cp_group
        layer.attn.cp_overlap = par.cp_overlap
        layer.attn.cp_clock = par.cp_clock
    if model.head is not None:
        model.head.shard(par.tp_group)
    _tag(model, tp)
    if par.sequence_parallel:
        try:
            model.set_sequence_parallel(True)
        except ValueError as e:  # a plan's layout the switch does not take
            raise ConfigError(f"parallel.sequence_parallel: {e}") from None
    model.wgrad = WeightGradStore() if par.defer_weight_grads else None
    for blk in model.blocks():
        for layer in blk.modules():
            if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
                layer.wgrad = model.wgrad
    if par.compile:  # each block's segments; compiled at their first call
        compile_blocks(model, strict=par.compile == "strict")
    if par.chunks is not None:
        _split_chunks(model, par)
    return model


def _refuse_under_cp(model: CausalLM, par: Parallelism, cp: int) -> None:
    """What context parallelism does not take, one line each, naming the pair.
    ``recompute`` is taken: under "full" each layer's ring runs again in backward (every
    cp rank recomputes the same layers in the same order, so the exchanges pair up);
    "selective" leaves the ring alone, whose backward already recomputes the
    probabilities from q, k, v and the saved output and log-sum-exp."""
    cfg, pair = model.cfg, f"context parallelism (cp={cp})"
    if cfg.sliding_window and cfg.sliding_window < cfg.seq_len:
        # the ring's blocks are causal or whole (cp_chunks.block_plan) with document masks;
        # a window would mask parts of off-diagonal blocks by position, which it does not do
        raise ValueError(f"{pair} with model.sliding_window={cfg.sliding_window}: ring "
                         f"attention has no sliding window")
    if par.degrees is not None:
        # a plan's per-block degrees come from the planner, which does not model cp
        raise ValueError(f"{pair} with per-block TP degrees (a plan): the planner does not "
                         f"know cp")
    if par.compile == "strict":
        # compile=true compiles the attention region in pieces around the ring (its
        # point-to-point exchanges and data-dependent skips are graph breaks); strict
        # asks for whole graphs
        raise ValueError(f"{pair} with parallel.compile='strict': the ring's exchanges "
                         f"break the attention region's graph")


def _split_chunks(model: CausalLM, par: Parallelism) -> None:
    """``model.chunks``: a view per virtual stage, its layers on that chunk's tracker."""
    trackers = par.chunk_trackers or (par.tracker,) * len(par.chunks)
    if len(trackers) != len(par.chunks):
        raise ValueError(f"{len(trackers)} trackers for {len(par.chunks)} chunks")
    views = []
    for (a, b), tracker in zip(par.chunks, trackers):
        view = model.chunk(a, b)
        view.tracker = tracker
        for layer in view.layers:
            layer.attn.tracker = tracker
        views.append(view)
    model.chunks = views


def _tag(model: CausalLM, tp: int) -> None:
    """``tp_degree`` on every parameter: the group its gradient is reduced over follows
    from it (:mod:`oases.parallel.reshard`); ``batch_part`` on a block below the home
    degree: the part of the batch it runs on."""
    for blk in model.blocks():
        for p in blk.parameters():
            p.tp_degree = blk.degree
        if model.resharder is not None and blk.degree < tp:
            blk.batch_part = (model.resharder.position(blk.degree)[0], tp // blk.degree)
    if model.is_last:
        for p in model.norm.parameters():
            p.tp_degree = tp
        table = model.embed.wte.weight if model.head is None else model.head.weight
        table.tp_degree = tp


def materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Every parameter made (uninitialised) on ``device``, its tags kept, and the model's
    buffers made again there (``reset_buffers``): a model parallelised on the meta device
    becomes this rank's. ``Module.to_empty`` would drop the tags."""
    made: dict[int, nn.Parameter] = {}  # a parameter held by two modules stays one
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            new = made.get(id(p))
            if new is None:
                new = nn.Parameter(torch.empty_like(p, device=device), p.requires_grad)
                new.__dict__.update(p.__dict__)
                made[id(p)] = new
            setattr(mod, name, new)
    if isinstance(model, CausalLM):
        model.reset_buffers()
    return model


def build(cls: type, cfg, padded_vocab: int, par: Parallelism, seed: Optional[int] = 0,
          device: torch.device | str = "cpu") -> CausalLM:
    """The model of class ``cls`` for ``cfg``, parallelised by ``par`` on the meta device,
    made on ``device`` and initialised from ``seed`` (None: left uninitialised, e.g.
    before loading a checkpoint). Only this rank's shard of this rank's stage is ever
    allocated; a seeded one on the host first, as the draws are the host's."""
    with torch.device("meta"):
        model = cls(cfg, padded_vocab)
    parallelize(model, par)
    if seed is None:
        return materialize(model, device)
    # drawn on the host (in place, its fast path), then moved in one copy per tensor
    materialize(model, "cpu")
    init_parameters(model, seed, group_rank(par.tp_group), group_size(par.tp_group))
    return model.to(device)
