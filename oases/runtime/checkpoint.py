"""Checkpoints with ``torch.distributed.checkpoint``: each rank writes its shard.

Layout under ``<out_dir>/checkpoints``:

    step_000040/          a complete checkpoint (DCP files + meta.json + rng/)
    step_000040.tmp/      a save in progress (ignored; removed by the next save)
    latest                the name of the newest complete checkpoint

A save writes everything into ``step_N.tmp``, waits for all ranks, then rank 0
renames the directory and only after that replaces ``latest`` (write + rename):
a crash at any point leaves ``latest`` naming a complete checkpoint.

Sharded parameters are saved as DTensors (``Shard(dim)`` over the TP mesh
dimension, ``Replicate()`` over DP), fused parameters (QKV, gate+up) one
DTensor per part, so every key is a true slice of a full tensor: DCP can
re-shard it for another TP degree. Replicated tensors are saved once.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from oases.errors import CheckpointError
from oases.parallel.groups import ParallelContext

SHAPE_KEYS = ("arch", "n_layer", "d_model", "n_head", "n_kv_heads", "ffn_hidden", "vocab_size",
              "seq_len", "tie_embeddings", "bias")


def _pieces(name: str, t: torch.Tensor, spec) -> list[tuple[str, torch.Tensor, object]]:
    """(key, local tensor view, spec-or-None) for one parameter-shaped tensor."""
    if spec is not None and spec.parts:
        out, off = [], 0
        tp_parts = [p * t.shape[spec.dim] // spec.full_shape[spec.dim] for p in spec.parts]
        for i, n in enumerate(tp_parts):
            full = list(spec.full_shape)
            full[spec.dim] = spec.parts[i]
            out.append((f"{name}.part{i}", t.narrow(spec.dim, off, n), (spec.dim, tuple(full))))
            off += n
        return out
    if spec is not None:
        return [(name, t, (spec.dim, tuple(spec.full_shape)))]
    return [(name, t, None)]


def _wrap(t: torch.Tensor, shard, ctx: ParallelContext):
    if shard is None or ctx.tp == 1 or ctx.mesh is None:
        return t
    dim, full = shard
    stride = torch.empty(full, device="meta").stride()
    return DTensor.from_local(t, ctx.mesh, [Replicate(), Shard(dim)], run_check=False,
                              shape=torch.Size(full), stride=stride)


def _state(model: nn.Module, opt: torch.optim.Optimizer, ctx: ParallelContext):
    """DCP state dict plus the (destination, key) list to copy loaded values back."""
    state, back = {}, []
    for name, p in model.named_parameters():
        spec = getattr(p, "tp_spec", None)
        tensors = {"model": p.data}
        st = opt.state.get(p, {})
        for k in ("exp_avg", "exp_avg_sq"):
            if k in st:
                tensors[f"optim.{k}"] = st[k]
        for prefix, t in tensors.items():
            for key, local, shard in _pieces(name, t, spec):
                state[f"{prefix}/{key}"] = _wrap(local, shard, ctx)
                back.append((local, f"{prefix}/{key}"))
        if "step" in st:
            state[f"optim.step/{name}"] = st["step"]
    return state, back


def ensure_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create zero Adam state, so a checkpoint can be loaded into it before any step."""
    for group in opt.param_groups:
        fused = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            if p not in opt.state or not opt.state[p]:
                opt.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32,
                                        device=p.device if fused else "cpu"),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }


def ckpt_root(out_dir: str) -> Path:
    return Path(out_dir) / "checkpoints"


def latest_checkpoint(out_dir: str) -> Optional[Path]:
    """The newest complete checkpoint, or None if there is none; a ``latest`` that
    names something incomplete is an error (never silently start over)."""
    root = ckpt_root(out_dir)
    ptr = root / "latest"
    if not ptr.exists():
        return None
    name = ptr.read_text().strip()
    path = root / name
    if not (path / "meta.json").is_file() or not (path / ".metadata").is_file():
        raise CheckpointError(f"checkpoint {path} named by {ptr} is partial or missing "
                              f"(no meta.json or .metadata)")
    return path


def save(out_dir: str, step: int, model: nn.Module, opt: torch.optim.Optimizer,
         ctx: ParallelContext, meta: dict, rng_state: dict, keep: int = 2) -> Path:
    root = ckpt_root(out_dir)
    name = f"step_{step:06d}"
    final, tmp = root / name, root / f"{name}.tmp"
    if ctx.is_main:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
        (tmp / "rng").mkdir()
    dist.barrier()
    state, _ = _state(model, opt, ctx)
    dcp.save(state, checkpoint_id=str(tmp))
    torch.save(rng_state, tmp / "rng" / f"rank{ctx.rank}.pt")
    dist.barrier()
    if ctx.is_main:
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if final.exists():  # re-saving a step (e.g. after a restart): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        ptr_tmp = root / "latest.tmp"
        ptr_tmp.write_text(name + "\n")
        os.replace(ptr_tmp, root / "latest")
        done = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load(path: Path, model: nn.Module, opt: torch.optim.Optimizer, ctx: ParallelContext,
         model_shape: dict) -> tuple[dict, Optional[dict]]:
    """Load model + optimizer state in place; returns (meta, this rank's RNG state or None
    if the checkpoint was written by a different world layout)."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path} has an unreadable meta.json: {e}") from None
    saved_shape = meta.get("model_shape", {})
    diff = [f"{k}: {saved_shape.get(k)} -> {model_shape.get(k)}" for k in SHAPE_KEYS
            if saved_shape.get(k) != model_shape.get(k)]
    if diff:
        raise CheckpointError(f"checkpoint {path} was saved for another model shape "
                              f"({'; '.join(diff)})")
    ensure_optimizer_state(opt)
    state, back = _state(model, opt, ctx)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as e:  # DCP raises a CheckpointException wrapping per-rank errors
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path} could not be loaded: {first}") from None
    with torch.no_grad():
        for dest, key in back:
            v = state[key]
            dest.copy_(v.to_local() if isinstance(v, DTensor) else v)
    for name, p in model.named_parameters():
        key = f"optim.step/{name}"
        if key in state and p in opt.state:
            opt.state[p]["step"].copy_(state[key])
    rng = None
    same_layout = meta.get("world_size") == ctx.world_size and meta.get("tp") == ctx.tp
    rng_file = path / "rng" / f"rank{ctx.rank}.pt"
    if same_layout and rng_file.is_file():
        rng = torch.load(rng_file, weights_only=False)
    return meta, rng
