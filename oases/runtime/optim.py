"""AdamW, the warmup + cosine LR schedule, and TP-aware gradient clipping."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases.config import TrainConfig
from oases.dp.master import grad_of
from oases.parallel.comm import all_reduce
from oases.parallel.sharding import part_views


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device,
                    params: Optional[list[tuple[torch.Tensor, nn.Parameter]]] = None
                    ) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on biases, norms or 1-d tensors).
    Fused on CUDA; the default (foreach) implementation elsewhere. ``params``: (tensor
    to step, model parameter it belongs to) pairs, when the optimizer steps ZeRO
    segments rather than parameters (``ZeroOwnership.optimizer_params``)."""
    decay, no_decay = [], []
    if params is None:
        params = [(p, p) for p in model.parameters() if p.requires_grad]
    for t, p in params:
        (decay if p.dim() >= 2 else no_decay).append(t)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=device.type == "cuda")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup to ``lr`` over
    ``warmup_steps``, then cosine decay to ``min_lr`` at ``steps``."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def _tp_parts(g: torch.Tensor, p: nn.Parameter, tp: int):
    """``g`` (a TP-sharded parameter's whole gradient, or a piece of it) as (view, weight)
    pairs, the weight making a sum over the TP group count the full parameter once: a
    block of degree t < tp is replicated over tp/t subgroups, and a part held alike by r
    ranks of its group (GQA kv heads) r times. None for a replicated parameter."""
    spec = getattr(p, "tp_spec", None)
    if spec is None:
        return None
    t = getattr(p, "tp_coords", (0, tp))[1]
    if g.shape != p.shape:  # a flat ZeRO piece: no replicated parts (those stay whole)
        return [(g, t / tp)]
    return [(v, t / tp / r) for v, r in part_views(g, spec, t)]


def weighted_squares(parts: list[tuple[torch.Tensor, float]], device: torch.device,
                      dtype: torch.dtype) -> torch.Tensor:
    """The sum of ``w * |g|^2`` over ``parts`` (0-d, ``dtype``): one foreach norm kernel per
    distinct weight (few: the TP degrees' shares), not two kernels per tensor. The weights
    multiply on the host side as Python floats: a weight tensor would be a copy to the
    device, which waits for its stream."""
    by_weight: dict[float, list[torch.Tensor]] = {}
    for g, w in parts:
        by_weight.setdefault(w, []).append(g)
    sq = torch.zeros((), device=device, dtype=dtype)
    for w, gs in by_weight.items():
        norms = torch._foreach_norm(gs, 2, dtype=dtype)
        sq = sq + torch.stack(norms).square().sum() * w
    return sq


@torch.no_grad()
def grad_norm(model: nn.Module, tp_group, stage_size: int = 0) -> torch.Tensor:
    """Global L2 norm of the gradient of the *full* model.

    Sharded parameters contribute their local squares, summed over the TP group;
    replicated parameters hold identical gradients on every TP rank and count once.
    (DP replicas hold identical gradients after the DP reduction: no DP term.)
    Pipelined (``stage_size``: ranks in this rank's stage, > 0 when pp > 1): every rank
    of a stage then holds its stage's square sum; each adds 1/stage_size of it to a sum
    over the world, which is the sum over stages. The last stage's copy of a tied
    embedding (``shared_copy``) is left out: the first stage counts it.
    """
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    sharded, replicated = [], []
    for p in model.parameters():
        g = grad_of(p)  # the fp32 main-grad under bf16 compute weights
        if g is not None and not (stage_size and getattr(p, "shared_copy", False)):
            parts = _tp_parts(g, p, tp)
            if parts is None:
                replicated.append(g)
            else:
                sharded += parts
    dev = next(model.parameters()).device
    sq_sharded = weighted_squares(sharded, dev, torch.float32)
    sq_repl = weighted_squares([(g, 1.0) for g in replicated], dev, torch.float32)
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        all_reduce(sq_sharded, tp_group)
    sq = sq_sharded + sq_repl
    if stage_size:
        sq = sq.to(torch.float64) / stage_size
        dist.all_reduce(sq)
    return sq.sqrt().float()


@torch.no_grad()
def sharded_grad_norm(terms: list[tuple[torch.Tensor, nn.Parameter, int]], tp: int, dp: int,
                      pp: bool) -> torch.Tensor:
    """:func:`grad_norm` when ZeRO splits gradients over ranks (``terms`` from
    ``ZeroOwnership.grad_terms``: gradient held, its parameter, G = ranks splitting it).

    Written as one sum over every rank of the stage: a TP shard of a degree-t block
    is held by dp tp / t ranks and weighs t / tp per rank, a replicated parameter by
    dp tp ranks and weighs 1 / tp, and everything is divided by dp. A gradient split
    over G ranks contributes G x its piece's squares, so the split pieces add up to
    the whole. Pipelined, the same sum over the world adds the stages."""
    dev = terms[0][0].device if terms else torch.device("cpu")
    parts = [(v, w * G) for g, p, G in terms if not (pp and getattr(p, "shared_copy", False))
             for v, w in _tp_parts(g, p, tp) or [(g, 1.0 / tp)]]
    sq = weighted_squares(parts, dev, torch.float64)
    sq /= dp
    dist.all_reduce(sq)
    return sq.sqrt().float()


def clip_grads(model: nn.Module, max_norm: float, tp_group, stage_size: int = 0,
               reducer=None, dp: int = 1) -> float:
    """:func:`clip_grads_norm`, its norm read on the host (which waits for the device)."""
    return float(clip_grads_norm(model, max_norm, tp_group, stage_size, reducer, dp))


@torch.no_grad()
def clip_grads_norm(model: nn.Module, max_norm: float, tp_group, stage_size: int = 0,
                    reducer=None, dp: int = 1) -> torch.Tensor:
    """Clip to ``max_norm`` (0: don't) and return the norm before clipping (over the
    whole pipeline when ``stage_size`` is given, see :func:`grad_norm`), a 0-d tensor
    on the device: nothing here waits for the device, the caller reads the norm when it
    needs it. With a ``reducer`` whose buckets are sharded (ZeRO), the gradients it
    holds are the ones measured and scaled (:func:`sharded_grad_norm`)."""
    if reducer is not None and getattr(reducer, "norm_by_terms", False):
        terms = reducer.ownership.grad_terms(model)
        tp = 1 if tp_group is None else dist.get_world_size(tp_group)
        norm = sharded_grad_norm(terms, tp, dp, stage_size > 0)
        grads = [g for g, _, _ in terms]
    else:
        norm = grad_norm(model, tp_group, stage_size)
        grads = [grad_of(p) for p in model.parameters() if grad_of(p) is not None]
    if max_norm > 0 and grads:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # on the device: no sync
        torch._foreach_mul_(grads, scale)
    return norm
