"""Where a run's weights come from: a checkpoint (``resume=auto``), a Hugging Face
directory (``model.init_from``) or the seeded init; and ``eval.only``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from models.hf import load_hf_weights
from oases.config import Config
from oases.config.hf import hf_dir_of
from oases.config.schema import SHAPE_KEYS
from oases.dp.ownership import ZeroOwnership
from oases.parallel.groups import ParallelContext
from oases.runtime import checkpoint as ckpt


def model_shape(cfg: Config) -> dict:
    return {k: getattr(cfg.model, k) for k in SHAPE_KEYS}


def layout_meta(ctx: ParallelContext) -> dict:
    """The layout a checkpoint was written with (its RNG states are per rank, so they are
    restored only under the same layout)."""
    meta = {"world_size": ctx.world_size, "tp": ctx.tp, "dp": ctx.dp, "pp": ctx.pp}
    if ctx.layout is not None:
        meta["stages"] = [{"layers": list(s.layers), "dp": s.dp, "tp": s.tp,
                           "degrees": list(s.degrees) if s.degrees is not None else None}
                          for s in ctx.layout.stages]
    return meta


def load_init_from(cfg: Config, ctx: ParallelContext, model) -> None:
    """Overwrite every parameter from ``model.init_from`` (unless resume=auto finds a
    checkpoint, which wins)."""
    existing = ckpt.latest_checkpoint(cfg.out_dir) if cfg.resume == "auto" else None
    if existing is not None:
        if ctx.is_main:
            print(f"model.init_from={cfg.model.init_from} not loaded: resume=auto "
                  f"continues from {existing}", flush=True)
        return
    load_hf_weights(model, hf_dir_of(cfg.model.init_from), ctx.tp_rank, ctx.tp)
    if ctx.is_main:
        print(f"model.init_from: loaded {cfg.model.init_from}", flush=True)


def resume(cfg: Config, ctx: ParallelContext, model, opt, batches, tracker,
           shards: Optional[ZeroOwnership] = None) -> Optional[dict]:
    """``resume=auto``: load the latest checkpoint into model, optimizer (``shards``: the
    run's ZeRO ownership, whose owned ranges are read in place), data position and RNG;
    returns its meta (None: nothing to resume, start at step 0)."""
    path = ckpt.latest_checkpoint(cfg.out_dir)
    if path is None:
        if ctx.is_main:
            print(f"resume=auto: no checkpoint in {cfg.out_dir}; starting from step 0",
                  flush=True)
            trim_metrics(cfg.out_dir, 0)  # records of a run that crashed before saving
        return None
    meta, rng = ckpt.load(path, model, opt, ctx, model_shape(cfg), layout_meta(ctx), shards)
    batches.load_state_dict(meta["data"])
    if rng is not None:
        tracker.set_states(rng)
    if ctx.is_main:
        print(f"resumed from {path} at step {meta['step']}", flush=True)
        trim_metrics(cfg.out_dir, meta["step"])
    return meta


def eval_only(cfg: Config, ctx: ParallelContext, model, opt, val, evaluate,
              shards: Optional[ZeroOwnership] = None) -> None:
    """Validation loss of the loaded weights (resume=auto's checkpoint, else init_from or
    the seeded init); one metrics.jsonl record is all that is written."""
    step, src = 0, cfg.model.init_from or f"seed {cfg.seed}"
    path = ckpt.latest_checkpoint(cfg.out_dir) if cfg.resume == "auto" else None
    if path is not None:
        step = ckpt.load(path, model, opt, ctx, model_shape(cfg), layout_meta(ctx),
                         shards)[0]["step"]
        src = str(path)
    val_loss = evaluate()
    if ctx.is_main:
        print(f"eval.only: val_loss {val_loss:.4f} | step {step} | weights {src} | "
              f"{len(val)} batches x {cfg.train.micro_batch_size * cfg.dp} x "
              f"{cfg.model.seq_len} tokens of {cfg.data.val_path}", flush=True)
        with open(Path(cfg.out_dir) / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "val_loss": val_loss}) + "\n")


def trim_metrics(out_dir: str, step: int) -> None:
    """After a resume from step N, drop records of steps > N written before the crash."""
    path = Path(out_dir) / "metrics.jsonl"
    if not path.exists():
        return
    keep = []
    for ln in path.read_text().splitlines():
        try:
            rec = json.loads(ln)
        except json.JSONDecodeError:  # a line torn by the crash
            continue
        if isinstance(rec, dict) and rec.get("step", 0) <= step:
            keep.append(ln)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(ln + "\n" for ln in keep))
    os.replace(tmp, path)
