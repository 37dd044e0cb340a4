"""ZeRO levels against level 0 (replicated), through the real build and step: the
config, what the trainer builds for a rank, parameters gathered whole over TP, and
:func:`run_levels` (3 optimizer steps per level). The tolerance (``PARAM_ATOL``) is
derived in tests/test_zero.py's docstring."""

from __future__ import annotations

import torch
import torch.distributed as dist

from oases.config import load_config
from oases.parallel.sharding import unshard
from oases.runtime.build import build_rank_model, seed_tracker, build_train_state
from oases.runtime.data import TrainBatches
from oases.runtime.optim import lr_at
from oases.runtime.step import train_step

STEPS = 3
PARAM_ATOL = 1e-5  # see the module docstring


def zero_config(world: int, tp: int, zero: int, schedule: str, recompute: str, extra=()):
    return load_config(None, [
        "model.name=gpt-tiny", "model.n_layer=2", "model.dropout=0", "model.seq_len=32",
        f"parallel.tp={tp}",
        f"parallel.schedule={schedule}", f"parallel.recompute={recompute}",
        f"parallel.zero={zero}", "data.kind=synthetic", "data.val_path=",
        "train.micro_batch_size=4", "train.grad_accum=2", f"train.steps={STEPS}",
        "train.warmup_steps=0", "train.lr=1e-3", "train.min_lr=1e-4",
        "parallel.dp_bucket_mb=0.05", *extra]).validate(world)


def full_params(model, ctx, tensor=lambda p: p.data) -> dict[str, torch.Tensor]:
    """{name: ``tensor(p)`` gathered whole over TP} for each parameter ``p``."""
    out = {}
    for name, p in model.named_parameters():
        t = tensor(p)
        parts = [t.clone()]  # tp 1: one part, and no TP group (None would be the world)
        if ctx.tp > 1:
            parts = [torch.empty_like(t) for _ in range(ctx.tp)]
            dist.all_gather(parts, t.contiguous(), group=ctx.tp_group)
        out[name] = unshard(parts, getattr(p, "tp_spec", None))
    return out


def build_rank(cfg, ctx, rows=None):
    """What the trainer builds for this rank: its TrainState (model, engine, optimizer,
    reducer, pipeline runner: None at pp = 1), those parts, and the data (``rows`` per DP
    rank and micro-batch)."""
    tracker = seed_tracker(cfg, ctx)
    model = build_rank_model(cfg, ctx, tracker, None, cfg.seed)
    ts = build_train_state(cfg, ctx, model, tracker)
    engine, opt, reducer, pipe = ts.engine, ts.opt, ts.reducer, ts.pipe
    batches = TrainBatches(cfg.data, cfg.model.seq_len, cfg.model.vocab_size,
                           rows or cfg.train.micro_batch_size, ctx.dp_rank, ctx.dp, cfg.seed)
    return ts, model, engine, opt, reducer, pipe, batches


def run_levels(ctx, levels, schedule, recompute, extra=()):
    """{level: (losses, norms, full params, store stats)} on every rank."""
    res = {}
    for zero in levels:
        cfg = zero_config(ctx.world_size, ctx.tp, zero, schedule, recompute, extra)
        ts, model, engine, opt, reducer, pipe, batches = build_rank(cfg, ctx)
        losses, norms = [], []
        for step in range(STEPS):
            loss, norm = train_step(ts, batches, lr_at(step, cfg.train))
            losses.append(loss)
            norms.append(norm)
        with reducer.ownership.unsharded(opt, model):
            params = full_params(model, ctx)
        store = reducer.ownership.store
        res[zero] = (losses, norms, params,
                     None if store is None else (store.gathers, store.late))
    return res
