"""Where a run's weights come from: a checkpoint (``resume=auto``), a Hugging Face
directory (``model.init_from``) or the seeded init; and ``eval.only``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

from oases.models.hf import load_hf_weights
from oases.config import Config
from oases.config.hf import hf_dir_of
from oases.dp.ownership import ZeroOwnership
from oases.errors import CheckpointError
from oases.parallel.groups import ParallelContext
from oases.runtime import checkpoint as ckpt
from oases.runtime import ckpt_files
from oases.runtime.run_dir import require_seen

# The model fields a resume may change: a label, regularisation and what only the first
# initialisation reads (vocabulary padding is resharded on load). Every other field
# (shapes, arch, RoPE and its scaling, norm_eps, sliding_window, ...) must match the
# checkpoint's, so a field added to the model section is checked unless listed here.
RESUME_FREE = ("name", "dropout", "init_std", "init_from", "vocab_pad_to")


def model_section(cfg: Config) -> dict:
    """The whole model section, as every checkpoint records it (``meta.json``'s
    ``model``): what export and generate rebuild the model from."""
    return {f.name: getattr(cfg.model, f.name) for f in dataclasses.fields(cfg.model)}


def model_shape(cfg: Config) -> dict:
    """The model's architecture: every field of the model section but
    :data:`RESUME_FREE`, each of which a checkpoint must match
    (:func:`oases.runtime.checkpoint.check_model`)."""
    return {k: v for k, v in model_section(cfg).items() if k not in RESUME_FREE}


def chosen_checkpoint(cfg: Config, ctx: ParallelContext) -> Optional[Path]:
    """The checkpoint ``resume=auto`` takes (rank 0 looks, every rank gets its answer,
    so a filesystem that shows ranks different things cannot split them), or None."""
    found, failure = None, None
    if ctx.is_main:
        try:
            found = ckpt.latest_checkpoint(cfg.out_dir)
        except CheckpointError as e:
            failure = str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        answer = [None if found is None else str(found), failure]
        dist.broadcast_object_list(answer, src=0)
        found, failure = (None if answer[0] is None else Path(answer[0])), answer[1]
    if failure is not None:
        raise CheckpointError(failure)
    if found is not None:  # a node-local out_dir: rank 0's checkpoint is not everywhere
        require_seen(cfg.out_dir, found, (found / "meta.json").is_file())
    return found


def layout_meta(ctx: ParallelContext, virtual: int = 1) -> dict:
    """The layout a checkpoint was written with (its RNG states are per rank, so they are
    restored only under the same layout). ``virtual``: ``parallel.pp_virtual`` (chunks per
    rank change which layers, so which random streams, a rank holds)."""
    meta = {"world_size": ctx.world_size, "tp": ctx.tp, "dp": ctx.dp, "pp": ctx.pp,
            "pp_virtual": virtual, "cp": ctx.cp}
    if ctx.layout is not None:
        meta["stages"] = [{"layers": list(s.layers), "dp": s.dp, "tp": s.tp,
                           "degrees": list(s.degrees) if s.degrees is not None else None}
                          for s in ctx.layout.stages]
    return meta


def load_init_from(cfg: Config, ctx: ParallelContext, model) -> None:
    """Overwrite every parameter from ``model.init_from`` (unless resume=auto finds a
    checkpoint, which wins)."""
    existing = ckpt.find_checkpoint(cfg.out_dir)[0] if cfg.resume == "auto" else None
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
    """``resume=auto``: load the checkpoint ``latest`` names (or the newest complete one,
    :func:`chosen_checkpoint`) into model, optimizer (``shards``: the run's ZeRO
    ownership, whose owned ranges are read in place), data position and RNG; returns its
    meta (None: nothing to resume, start at step 0). Reads only: the caller trims
    ``metrics.jsonl`` (:func:`trim_metrics`) once it may write."""
    path = chosen_checkpoint(cfg, ctx)
    if path is None:
        if ctx.is_main:
            print(f"resume=auto: no checkpoint in {cfg.out_dir}; starting from step 0",
                  flush=True)
        return None
    check_corpus(path, ckpt.read_meta(path), cfg, batches.corpus)  # before the long read
    meta, rng = ckpt.load(path, model, opt, ctx, model_shape(cfg),
                          layout_meta(ctx, cfg.parallel.pp_virtual), shards)
    batches.load_state_dict(meta["data"])
    if rng is not None:
        tracker.set_states(rng)
    if ctx.is_main:
        print(f"resumed from {path} at step {meta['step']}", flush=True)
    return meta


def _corpus(ident) -> str:
    if not isinstance(ident, dict):
        return "synthetic data or a blend"
    files = ident.get("files") or []
    names = ", ".join(f"{n} ({b} bytes)" for n, b in files[:3])
    more = f" and {len(files) - 3} more files" if len(files) > 3 else ""
    sha = ident.get("meta_sha256")
    return (f"{ident.get('tokens')} tokens in {names or 'no file'}{more}, "
            f"{f'meta.json sha256 {sha[:16]}' if sha else 'no meta.json'}")


def check_corpus(path: Path, meta: dict, cfg: Config, corpus: Optional[dict]) -> None:
    """Refuse a single ``data.train_path`` that is not the corpus the checkpoint was
    trained on (``corpus``: this run's :func:`oases.runtime.data.corpus_identity`, None
    for synthetic data and blends, which check their own). A checkpoint that records no
    corpus (written before it was recorded) is taken as it is."""
    if "corpus" not in meta or meta["corpus"] == corpus:
        return
    here = f"data.train_path={cfg.data.train_path}" if corpus is not None else "this run's data"
    raise CheckpointError(f"checkpoint {path} was trained on {_corpus(meta['corpus'])}, but "
                          f"{here} is {_corpus(corpus)}; resume with the checkpoint's "
                          f"corpus (other data needs a new out_dir)")


def eval_only(cfg: Config, ctx: ParallelContext, model, opt, val, evaluate,
              shards: Optional[ZeroOwnership] = None,
              claim: Callable[[], None] = lambda: None) -> None:
    """Validation loss of the loaded weights (resume=auto's checkpoint, else init_from or
    the seeded init); one metrics.jsonl record is all that is written."""
    step, src = 0, cfg.model.init_from or f"seed {cfg.seed}"
    path = chosen_checkpoint(cfg, ctx) if cfg.resume == "auto" else None
    if path is not None:
        step = ckpt.load(path, model, opt, ctx, model_shape(cfg),
                         layout_meta(ctx, cfg.parallel.pp_virtual), shards)[0]["step"]
        src = str(path)
    val_loss = evaluate()
    claim()  # before the one write, as a run's first write into out_dir
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
    ckpt_files.write_atomic(path, "".join(ln + "\n" for ln in keep).encode())
