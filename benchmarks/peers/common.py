"""What both peers share: the command line, the synthetic data, init, timing, the JSON.

Kept free of oases imports on purpose: a peer must not borrow oases code paths.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist


def parse_args(description: str, extra: Callable | None = None) -> argparse.Namespace:
    """The shared CLI; ``extra(parser)`` may add a peer's own flags."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    if extra:
        extra(p)
    p.add_argument("--d-model", type=int, required=True)
    p.add_argument("--n-layer", type=int, required=True)
    p.add_argument("--n-head", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--micro-batch-size", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, default=0,
                   help="steps the consumer should drop; all steps are timed and written")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--ffn", type=int, default=None, help="MLP hidden width (default 4*d)")
    p.add_argument("--vocab-pad-to", type=int, default=64,
                   help="pad the vocabulary to a multiple of this x tp, as oases does")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0,
                   help="global-norm clipping as in oases' train_step (0: off)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--fixed-batch", action="store_true",
                   help="tests/test_peers.py only: train on the step-0 batch every step "
                        "(loss must fall)")
    p.add_argument("--dump-init", default="",
                   help="tests/test_peers.py only: rank 0 saves the full initial weights "
                        "(torch.save)")
    p.add_argument("--out-json", required=True)
    a = p.parse_args()
    if a.ffn is None:
        a.ffn = 4 * a.d_model
    if a.d_model % a.n_head:
        p.error("--d-model must be divisible by --n-head")
    if a.warmup >= a.steps:
        p.error("--warmup must be smaller than --steps")
    return a


def init_gloo() -> tuple[int, int]:
    """Join the torchrun world (or make a world of one for a plain `python`)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    return dist.get_rank(), dist.get_world_size()


def padded_vocab(vocab: int, pad_to: int, tp: int) -> int:
    m = pad_to * tp
    return math.ceil(vocab / m) * m


def batch(step: int, args, gen_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic tokens, (B, T+1) -> inputs and next-token targets; identical on every
    rank (TP ranks see the same micro-batch) and a function of (seed, step) only."""
    if args.fixed_batch:
        step = 0
    g = torch.Generator().manual_seed(gen_seed * 1_000_003 + step)
    t = torch.randint(0, args.vocab, (args.micro_batch_size, args.seq_len + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def adamw_groups(named_params) -> list[dict]:
    """Weight decay on matrices only (as oases): a list of param groups; the caller sets
    weight_decay on the first."""
    decay, no_decay = [], []
    for _, p in named_params:
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def train_loop(args, rank: int, step_fn: Callable[[int], tuple]) -> tuple[list, list, list]:
    """Run ``args.steps`` steps; ``step_fn(step)`` does forward+backward+optimizer step and
    returns (loss, grad norm before clipping) as tensors. Barrier, then time the step."""
    times, losses, norms = [], [], []
    for step in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss, norm = step_fn(step)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        norms.append(float(norm))
        if rank == 0:
            print(f"step {step + 1:4d}  loss {losses[-1]:.6f}  grad_norm {norms[-1]:.4f}  "
                  f"{times[-1] * 1e3:8.1f} ms", flush=True)
    return times, losses, norms


def write_json(args, rank: int, world: int, peer: str, times, losses, versions: dict,
               extra: dict | None = None, n_params: int | None = None,
               grad_norms: list | None = None) -> None:
    if rank != 0:
        return
    out = {"peer": peer, "step_times_s": times,
           "tokens_per_step": args.micro_batch_size * args.seq_len,
           "losses": losses, "grad_norms": grad_norms,
           "versions": {"python": platform.python_version(), "torch": torch.__version__,
                        **versions},
           "tp": world, "dp": 1, "warmup": args.warmup, "n_params": n_params,
           "fixed_batch": args.fixed_batch, "grad_clip": args.grad_clip, "lr": args.lr,
           "shape": {"d_model": args.d_model, "n_layer": args.n_layer, "n_head": args.n_head,
                     "ffn": args.ffn, "seq_len": args.seq_len,
                     "micro_batch_size": args.micro_batch_size, "vocab": args.vocab},
           "threads": torch.get_num_threads(),
           "command": " ".join([Path(sys.executable).name] + sys.argv)}
    if extra:
        out.update(extra)
    path = Path(args.out_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}", flush=True)
