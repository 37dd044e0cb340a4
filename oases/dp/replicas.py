"""Rows of a TP-sharded parameter that several ranks hold alike, and the sum of their
gradients over those replicas.

GQA above ``n_kv_heads`` TP ranks (oases.config.heads) is the case: the fused qkv
projection keeps each kv head whole, so the r = t / n_kv_heads ranks of a degree-t
group that share a kv head hold the same k and v rows W_h (``part_views`` reports
them with ``replicas`` r). Why their gradients must be summed over the *kv replica
group* {ranks holding head h}:

    forward   K_j = X W_h^T on each replica j; K_j feeds only rank j's query heads,
              so the loss is L = sum_j L_j(K_j) + (terms without W_h)
    backward  autograd on rank j gives  G_j = dL_j/dK_j^T X,   its own share only
              dL/dW_h = sum_j G_j          (the r ranks' terms, each counted once)

After the sum every replica holds dL/dW_h, the same Adam update keeps the replicas
equal, and the model equals the unreplicated one. The input gradient needs no
change: dL/dX = sum over every TP rank of dL/dY_j W_j, where rank j's rows are its
q heads and its kv share; the column-parallel all-reduce of dX over the TP group
adds each term once (a replica's kv term is its own query heads' part, not a copy).

When: once per step, after the DP reduction (``GradReducer``'s ``then``). Both are
sums, so the order is free, and a per-step sum costs one all-reduce per group
instead of one per micro- and sub-batch inside backward (the ``oases`` engine's
overlapped backward stays as it is). The sums are exposed, not hidden behind the
backward; the planner's cost model counts them (``CostModel._kv_sync``). The rows
of one rank at one degree go in one flat buffer: one all-reduce per degree.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases.dp.master import grad_of
from oases.parallel.comm import all_reduce
from oases.parallel.model_view import view_of
from oases.parallel.sharding import part_views


def replicated_views(p: torch.Tensor, like: nn.Parameter) -> list[torch.Tensor]:
    """The replicated slices of ``p`` (``like`` itself, or its gradient / Adam moment)."""
    spec = getattr(like, "tp_spec", None)
    if spec is None or not spec.units:
        return []
    size = getattr(like, "tp_coords", (0, 1))[1]
    return [v for v, r in part_views(p, spec, size) if r > 1]


class ReplicaGradSum:
    """Sums the gradients of replicated rows over their replica groups (see the module
    docstring). ``group_of(t)``: the replica group of this rank's blocks of degree t."""

    def __init__(self, params: dict[int, list[nn.Parameter]],
                 group_of: Callable[[int], Optional[dist.ProcessGroup]]) -> None:
        self.params = params          # degree -> parameters with replicated rows
        self.group_of = group_of

    @classmethod
    def for_model(cls, model: nn.Module, group_of, tp: int) -> Optional["ReplicaGradSum"]:
        """The sum for ``model``'s replicated parameters (None: it has none). A parameter's
        degree is its block's (``tp_degree``), tp by default. Every degree with replicated
        rows must have a replica group of as many ranks as the rows have replicas: a
        context built without the model's kv heads (or for other ones) would otherwise
        train the replicas apart without a word."""
        params: dict[int, list[nn.Parameter]] = {}
        for p in model.parameters():
            spec = getattr(p, "tp_spec", None)
            size = getattr(p, "tp_coords", (0, 1))[1]
            reps = {r for _, r in part_views(p.data, spec, size) if r > 1} if spec else set()
            if not (p.requires_grad and reps):
                continue
            t = getattr(p, "tp_degree", tp)
            group = group_of(t)
            have = 1 if group is None else dist.get_world_size(group)
            if reps != {have}:
                raise ValueError(f"blocks of TP degree {t} hold kv heads replicated on "
                                 f"{max(reps)} ranks but the kv replica group has {have}: "
                                 f"build the parallel context with kv_heads=model.n_kv_heads")
            params.setdefault(t, []).append(p)
        return cls(params, group_of) if params else None

    @torch.no_grad()
    def __call__(self) -> None:
        for t in sorted(self.params):  # the same order on every rank
            group = self.group_of(t)
            _sum_in_place([v for p in self.params[t] if grad_of(p) is not None
                           for v in replicated_views(grad_of(p), p)], group)


def _sum_in_place(tensors: list[torch.Tensor], group) -> None:
    """Each tensor summed over ``group`` in place, all in one flat all-reduce."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    all_reduce(flat, group)
    off = 0
    for t in tensors:
        t.copy_(flat[off: off + t.numel()].view_as(t))
        off += t.numel()


class SequenceGradSum:
    """Under sequence parallelism (oases.parallel.sequence) each parameter no TP rank
    shards (norm weights, row-parallel biases, learned positions) has a partial gradient
    on each rank, whose sum over its block's TP group is the gradient: in a prologue or a
    combine it acts on this rank's chunk of the sequence only, and inside a region,
    before the column-parallel layers, it sees the un-reduced input gradient (the
    all-gather's reduce-scatter sums it later, where the all-reduce at the region's entry
    summed it before). A block of degree t < tp sums over its own t-rank subgroup (its
    other batch parts are the DP reducer's, oases.parallel.reshard). Once per step, after
    the DP reduction (both are sums; Megatron-LM sums its layer norms' alike); one
    all-reduce of one flat buffer per degree."""

    def __init__(self, params: dict[int, tuple]) -> None:
        self.params = params  # degree -> (group, [parameters])

    @classmethod
    def for_model(cls, model: nn.Module, group) -> Optional["SequenceGradSum"]:
        """The sum for ``model`` when it runs sequence parallel over more than one rank
        (None otherwise, or when it has no unsharded parameters). ``group``: the TP group
        (of the parameters outside ``model.blocks()``, and of blocks without their own)."""
        if not view_of(model).sequence_parallel or group is None \
                or dist.get_world_size(group) == 1:
            return None
        tp = dist.get_world_size(group)
        by_degree: dict[int, tuple] = {}
        seen = set()
        for blk in model.blocks():  # TPBlocks: a sequence-parallel model is an EngineModel
            t, g = blk.degree, blk.tp_group
            for p in blk.parameters():
                seen.add(id(p))
                if p.requires_grad and getattr(p, "tp_spec", None) is None and t > 1:
                    by_degree.setdefault(t, (g, []))[1].append(p)
        for p in model.parameters():
            if id(p) not in seen and p.requires_grad and getattr(p, "tp_spec", None) is None:
                by_degree.setdefault(tp, (group, []))[1].append(p)
        return cls(by_degree) if by_degree else None

    @torch.no_grad()
    def __call__(self) -> None:
        # every rank sums the same degrees in the same order (a rank's plan degrees are
        # the same set on every rank of its stage)
        for t in sorted(self.params):
            group, params = self.params[t]
            _sum_in_place([grad_of(p) for p in params if grad_of(p) is not None], group)
