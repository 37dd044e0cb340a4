"""Peer: oases' own stage modules driven by ``torch.distributed.pipelining.Schedule1F1B``.

    torchrun --nproc-per-node 4 -m benchmarks.peers.torch_pipelining --pp 2 --tp 2 \
        --d-model 128 --n-layer 4 --n-head 4 --seq-len 64 --micro-batch-size 4 \
        --microbatches 4 --steps 4 --warmup 1 --out-json /tmp/pipe.json

The same stage model as ``train.py parallel.pp=2 parallel.tp=2 parallel.schedule=megatron``:
the layout comes from ``oases.parallel.layout.uniform_layout`` (stage s = ranks s*tp .. s*tp+tp-1,
TP inside a stage), the groups from ``oases.parallel.groups.build_pipeline_context`` and
the stage's model from ``oases.runtime.build.build_rank_model`` (``oases.models.build_model(...,
stage=(a, b))``; blocking Megatron TP all-reduces inside autograd, ``--recompute``
full by default, as the ``megatron+full`` baseline). Only the pipeline driver differs:
each stage is a ``torch.distributed.pipelining.PipelineStage`` (static shapes) on a
pp group of the ranks with the same TP position ({0, 2} and {1, 3} at pp 2 x tp 2) and
``Schedule1F1B`` runs it. So every TP rank sends its own copy of the activation across
the stage boundary (oases' ``broadcast`` transfer sends each byte once), and the
schedule waits for a forward send together with the next backward receive.

Embeddings are **untied** (``model.tie_embeddings=false``): torch's stages know nothing
of a weight shared by the first and last stage. The benchmark runs the oases modes
untied too, so all modes train the same model.

Our stage model's forward is ``model(x, targets)``; the last stage returns the mean
loss. The wrapper passes ``targets`` as a keyword argument (Schedule1F1B chunks keyword
arguments per micro-batch and hands them to the stage's forward) and the schedule's
``loss_fn`` returns the stage output as the loss. ``scale_grads`` divides by the number
of micro-batches, as oases' 1/n loss scale. Data (oases' synthetic stream), learning
rate schedule, global-norm clipping over all stages and AdamW are oases' own
(``oases.runtime``), so this peer trains exactly as ``train.py``'s megatron+full+1f1b
does (same losses and gradient norms, step by step, up to float rounding): only the
pipeline driver and its transfers differ.

Writes ``{"step_times_s": [...], "tokens_per_step": n, "losses": [...]}`` (rank 0).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--d-model", type=int, required=True)
    p.add_argument("--n-layer", type=int, required=True)
    p.add_argument("--n-head", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--micro-batch-size", type=int, required=True)
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--recompute", default="full", choices=("none", "full"))
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--out-json", required=True)
    return p.parse_args()


class StageModule(nn.Module):
    """``model(x, targets)`` as a pipelining stage: ``targets`` arrives as a kwarg."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(x, targets)


def main() -> int:
    a = parse_args()
    torch.manual_seed(0)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from oases.config import load_config
    from oases.parallel.groups import build_pipeline_context
    from oases.parallel.layout import uniform_layout
    from oases.runtime.build import build_rank_model, seed_tracker
    from oases.runtime.data import TrainBatches
    from oases.runtime.optim import build_optimizer, clip_grads, lr_at

    d = a.d_model
    cfg = load_config(None, [
        "model.name=gpt-tiny", "model.arch=gpt", f"model.d_model={d}",
        f"model.n_layer={a.n_layer}", f"model.n_head={a.n_head}", f"model.n_kv_heads={a.n_head}",
        f"model.ffn_hidden={4 * d}", f"model.seq_len={a.seq_len}", f"model.vocab_size={a.vocab}",
        "model.tie_embeddings=false", f"parallel.tp={a.tp}", f"parallel.pp={a.pp}",
        "parallel.schedule=megatron", f"parallel.recompute={a.recompute}",
        f"train.micro_batch_size={a.micro_batch_size}", f"train.grad_accum={a.microbatches}",
        "data.kind=synthetic",
    ]).validate(world)
    device = torch.device("cpu")
    layout = uniform_layout(world, a.pp, a.tp, a.n_layer)
    if any(s.dp != 1 for s in layout.stages):
        raise SystemExit("this peer runs dp=1 stages only (world = pp x tp)")
    ctx = build_pipeline_context(layout, device, tie_embeddings=False)
    pp_group = None
    for t in range(a.tp):  # the ranks with the same TP position, one per stage
        ranks = [st.first + t for st in layout.stages]
        g = dist.new_group(ranks)
        if rank in ranks:
            pp_group = g
    tracker = seed_tracker(cfg, ctx)
    model = build_rank_model(cfg, ctx, tracker, None, cfg.seed)
    model.train()
    mbs, T = a.micro_batch_size, a.seq_len
    first, last = ctx.is_first_stage, ctx.is_last_stage
    # static shapes; requires_grad says which activations carry a gradient back
    ex_in = (torch.zeros(mbs, T, dtype=torch.long) if first
             else torch.zeros(mbs, T, d, requires_grad=True))
    ex_out = torch.zeros((), requires_grad=True) if last else torch.zeros(mbs, T, d,
                                                                           requires_grad=True)
    stage = PipelineStage(StageModule(model), ctx.stage, a.pp, device, input_args=(ex_in,),
                          output_args=(ex_out,), group=pp_group)
    sched = Schedule1F1B(stage, a.microbatches, loss_fn=lambda out, _tgt: out, scale_grads=True)
    opt = build_optimizer(model, cfg.train, device)
    times, losses, norms = [], [], []
    n_rows = mbs * a.microbatches
    # oases' own synthetic stream, so step 1's loss and gradient norm equal train.py's
    batches = TrainBatches(cfg.data, T, a.vocab, mbs, 0, 1, cfg.seed)
    for step in range(a.steps):
        micro = [batches.next_batch() for _ in range(a.microbatches)]
        x = torch.cat([m[0] for m in micro])
        y = torch.cat([m[1] for m in micro])
        dist.barrier()
        t0 = time.perf_counter()
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, cfg.train)
        opt.zero_grad(set_to_none=True)
        step_losses: list = []
        if first:
            sched.step(x)
        elif last:
            # loss_fn ignores target; the outputs (scalar losses) are not merged
            sched.step(targets=y, target=y, losses=step_losses, return_outputs=False)
        else:
            sched.step()
        norm = clip_grads(model, cfg.train.grad_clip, ctx.tp_group, ctx.stage_size)
        opt.step()
        loss = torch.tensor([float(torch.stack(step_losses).mean()) / ctx.tp if step_losses
                             else 0.0])
        dist.all_reduce(loss)
        dt = time.perf_counter() - t0
        times.append(dt)
        losses.append(float(loss))
        norms.append(norm)
        if rank == 0:
            print(f"step {step + 1:4d}  loss {losses[-1]:.6f}  grad_norm {norm:.4f}  "
                  f"{dt * 1e3:8.1f} ms", flush=True)
    if rank == 0:
        Path(a.out_json).write_text(json.dumps({
            "peer": "torch.distributed.pipelining.Schedule1F1B", "step_times_s": times,
            "tokens_per_step": n_rows * T, "losses": losses, "grad_norms": norms,
            "torch": torch.__version__}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
