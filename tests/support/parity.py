"""The parity oracle: losses and gradients against the unsharded reference.

Tensor parallelism (the engines): :func:`sub_batch_reference` is plain autograd
(``megatron``, ``none``) run on each sub-batch alone from that sub-batch's RNG streams
(``sub_batch_rng_streams``), its losses averaged: the same computation, dropout masks
included, that the oases engine runs interleaved; :func:`full_grads` gathers each
gradient whole over TP to compare with it (atol 1e-6 / rtol 1e-5 in fp32).

Pipelines: :func:`unsharded_reference` trains one unsharded process on the same global
batch; :func:`run_case` trains this rank's stage of a layout and checks both steps'
losses, the first step's gradient norm and every gradient shard against it (losses and
norm rtol 1e-5, gradients rtol 1e-4 / atol 1e-6). Inside a world the reference is
:func:`shared_reference`'s: trained once, on rank 0, and broadcast to every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from oases.overlap.engines import MegatronEngine
from oases.overlap.rng_streams import rng_restore, sub_batch_rng_streams
from oases.parallel import unshard

# (engine, recompute) pairs every TP parity test runs against the reference
PAIRS = [("megatron", "full"), ("megatron", "selective"), ("oases", "none"),
         ("oases", "selective"), ("oases", "full"), ("oases", "fine")]

# the pipeline parity cases: world, sequence length, micro-batch per DP rank
WORLD = 4
SEQ = 16
MBS = 4


def full_grads(model, ctx) -> dict:
    out = {}
    for n, p in model.named_parameters():
        g = p.grad.contiguous()
        if p.tp_spec is not None and ctx.tp > 1:
            gs = [torch.empty_like(g) for _ in range(ctx.tp)]
            dist.all_gather(gs, g, group=ctx.tp_group)
            g = unshard(gs, p.tp_spec)
        out[n] = g
    return out


def sub_batch_reference(model, tracker, ids, y, n_sub):
    """Plain autograd on each sub-batch from its own RNG streams."""
    streams = sub_batch_rng_streams(tracker, ids.device, n_sub)
    losses = []
    for s, (a, b) in enumerate(zip(ids.chunk(n_sub), y.chunk(n_sub))):
        rng_restore(tracker, ids.device, streams[s])
        loss = MegatronEngine().forward_backward(model, a, b, 1.0 / n_sub)
        losses.append(loss)
    return torch.stack(losses).mean()


def unsharded_reference(cfg, steps: int):
    """Losses, norm and gradients (after step 1) of one unsharded process."""
    from oases.models import build_model
    from oases.dp.reducer import GradReducer
    from oases.parallel.groups import ParallelContext
    from oases.runtime.data import TrainBatches
    from oases.runtime.optim import build_optimizer
    from oases.runtime.step import TrainState, train_step

    ctx = ParallelContext.single()
    model = build_model(cfg.model, cfg.padded_vocab(1), None, seed=cfg.seed)
    opt = build_optimizer(model, cfg.train, ctx.device)
    reducer = GradReducer(model, None)
    batches = TrainBatches(cfg.data, cfg.model.seq_len, cfg.model.vocab_size,
                           cfg.pipeline_batch, 0, 1, cfg.seed)
    losses, grads, norm = [], None, None
    for s in range(steps):
        loss, n = train_step(TrainState(cfg, ctx, model, opt, reducer), batches, cfg.train.lr)
        losses.append(loss)
        if s == 0:
            norm = n
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return losses, norm, grads


def shared_reference(cfg, steps: int):
    """:func:`unsharded_reference` for every rank of the default group: trained on rank 0
    alone and broadcast (the same for every rank, and N times cheaper than each rank
    training it). It draws from no rank's global RNG (forked), so the sharded run that
    follows starts from the state it would have without it."""
    out = [None]
    if dist.get_rank() == 0:
        with torch.random.fork_rng(devices=[]):
            out[0] = unsharded_reference(cfg, steps)
    dist.broadcast_object_list(out, src=0)
    return out[0]


def check_grads(model, ctx, ref_grads: dict, what: str) -> None:
    from oases.parallel.sharding import shard

    for name, p in model.named_parameters():
        spec = getattr(p, "tp_spec", None)
        rank, size = getattr(p, "tp_coords", (ctx.tp_rank, ctx.tp))
        want = shard(ref_grads[name], spec, rank, size)
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{what}: {name}: {m}")


def stage(cfg, layout):
    """(ctx, model, training state, this rank's batches) of this rank's stage."""
    from oases.parallel.groups import build_pipeline_context
    from oases.runtime.build import build_rank_model, seed_tracker, build_train_state
    from oases.runtime.data import TrainBatches

    ctx = build_pipeline_context(layout, torch.device("cpu"), bool(cfg.model.tie_embeddings))
    tracker = seed_tracker(cfg, ctx)
    model = build_rank_model(cfg, ctx, tracker, None, cfg.seed)
    ts = build_train_state(cfg, ctx, model, tracker)
    batches = TrainBatches(cfg.data, cfg.model.seq_len, cfg.model.vocab_size,
                           cfg.pipeline_batch // ctx.dp, ctx.dp_rank, ctx.dp, cfg.seed)
    return ctx, model, ts, batches


def run_case(rank: int, cfg, layout, steps: int, what: str) -> None:
    from oases.runtime.step import train_step

    ctx, model, ts, batches = stage(cfg, layout)
    st = layout.stages[ctx.stage]
    degrees = [b.degree for layer in model.layers for b in (layer.attn, layer.mlp)]
    assert degrees == list(st.degrees or [st.tp] * len(degrees)), (what, degrees)
    ref_losses, ref_norm, ref_grads = shared_reference(cfg, steps)
    for s in range(steps):
        loss, norm = train_step(ts, batches, cfg.train.lr)
        assert abs(loss - ref_losses[s]) <= 1e-5 * abs(ref_losses[s]), \
            f"{what}: step {s + 1} loss {loss} vs {ref_losses[s]}"
        if s == 0:
            assert abs(norm - ref_norm) <= 1e-5 * ref_norm, f"{what}: norm {norm} vs {ref_norm}"
            check_grads(model, ctx, ref_grads, what)
