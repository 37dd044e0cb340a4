"""AdamW, the warmup + cosine LR schedule, and TP-aware gradient clipping."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from oases.config import TrainConfig
from oases.parallel.comm import all_reduce
from oases.parallel.sharding import part_views


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on biases, norms or 1-d tensors).
    Fused on CUDA; the default (foreach) implementation elsewhere."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
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
    T = 1 if tp_group is None else dist.get_world_size(tp_group)
    sharded, replicated = [], []
    for p in model.parameters():
        if p.grad is not None and not (stage_size and getattr(p, "shared_copy", False)):
            spec = getattr(p, "tp_spec", None)
            if spec is not None:
                # a block of degree t < T is replicated over T/t subgroups, and a part
                # held alike by r ranks of its group (GQA kv heads) r times: count once
                t = getattr(p, "tp_coords", (0, T))[1]
                sharded += [(g, t / T / r) for g, r in part_views(p.grad, spec, t)]
            else:
                replicated.append(p.grad)
    dev = next(model.parameters()).device
    sq_sharded = sum((g.float().pow(2).sum() * w for g, w in sharded), torch.zeros((), device=dev))
    sq_repl = sum((g.float().pow(2).sum() for g in replicated), torch.zeros((), device=dev))
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        all_reduce(sq_sharded, tp_group)
    sq = sq_sharded + sq_repl
    if stage_size:
        sq = sq.to(torch.float64) / stage_size
        dist.all_reduce(sq)
    return sq.sqrt().float()


@torch.no_grad()
def clip_grads(model: nn.Module, max_norm: float, tp_group, stage_size: int = 0) -> float:
    """Clip to ``max_norm`` (0: don't) and return the norm before clipping (over the
    whole pipeline when ``stage_size`` is given, see :func:`grad_norm`)."""
    norm = grad_norm(model, tp_group, stage_size)
    if max_norm > 0:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
    return float(norm)
