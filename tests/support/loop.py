"""Whole training runs through the trainer's own loop (``trainer.train``) in gloo worker
processes (:mod:`tests.support.distributed`), without torchrun:

    train_workers(out, world=2, overrides=["parallel.pp=2", ...])
    records(out)        # {step: metrics record}

Each worker builds its process groups as ``train.py`` does (a pipeline context when
``parallel.pp > 1``), the main rank checks ``out_dir``, then every rank runs the loop.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from oases.config import load_config
from oases.parallel.groups import build_context, build_pipeline_context
from oases.planner.online import resolve_layout
from oases.runtime import trainer
from tests.support.distributed import run_distributed


def train_worker(rank: int, overrides: list[str], config: str | None = None) -> None:
    """``run_distributed(train_worker, world, tp=None, args=(overrides, config))``'s body:
    ``config`` (None: the defaults) with ``overrides``, on this worker's groups."""
    world = dist.get_world_size()
    cfg = load_config(config, overrides).validate(world)
    cp = cfg.parallel.cp
    if cfg.parallel.pp > 1:
        ctx = build_pipeline_context(resolve_layout(cfg, world), torch.device("cpu"),
                                     bool(cfg.model.tie_embeddings), cp=cp)
    else:
        ctx = build_context(cfg.parallel.tp, torch.device("cpu"), cp=cp)
    if ctx.is_main:
        trainer.check_out_dir(cfg)
    dist.barrier()
    trainer.train(cfg, ctx)


def train_workers(out: Path, world: int, overrides: list[str], config: str | None = None) -> None:
    """A run into ``out`` on ``world`` gloo workers."""
    run_distributed(train_worker, world=world, tp=None,
                    args=([*overrides, f"out_dir={out}"], config))


def records(out: Path) -> dict[int, dict]:
    """``out``/metrics.jsonl's training records by step (each step once, in order)."""
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "loss" in r]
    steps = [r["step"] for r in recs]
    assert steps == sorted(set(steps)), steps
    return {r["step"]: r for r in recs}


def check_exact_resume(tmp: Path, world: int, run: list[str], steps=(3, 4)) -> None:
    """``run`` into ``tmp``/a on ``world`` workers, then a copy of it resumed from its
    checkpoint: the resumed ``steps``' losses and gradient norms equal the first run's,
    bit for bit."""
    from tests.support.runs import resume_copy

    a = tmp / "a"
    train_workers(a, world, run)
    ra = records(a)
    c = resume_copy(a, tmp / "c")
    train_workers(c, world, [*run, "resume=auto"])
    rc = records(c)
    for s in steps:
        assert rc[s]["loss"] == ra[s]["loss"] and rc[s]["grad_norm"] == ra[s]["grad_norm"], s
