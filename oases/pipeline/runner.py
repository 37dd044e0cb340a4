"""The pipeline runtime: one rank's stage runs its action list for one optimizer step.

Each stage's action list comes from :mod:`oases.pipeline.schedules` (gpipe, 1f1b,
eager-1f1b, zb-h1, eager-zb-h1, interleaved-1f1b). An ``F``/``B`` action runs the stage's blocks through the engine
(an :class:`~oases.parallel.engine.Engine`, ``megatron`` or ``oases``: inside every
action the oases engine still takes turns between two sub-batches so its TP
collectives overlap compute); ``RECV``/``SEND``
actions post cross-mesh transfers (:mod:`oases.pipeline.cross_mesh`), which run
in the background while the next compute action does:

    stage 0 (1f1b, 4 micro-batches, pp 2):
      compute  | F0 | F1 |   | B0 | F2 | B1 | F3 | B2 |   | B3 |
      sends       s0   s1       g0   s2   ...
    stage 1:
      compute  |    | F0 | B0 | F1 | B1 | F2 | B2 | F3 | B3 |

Stage boundaries may change the layout (dp_a x tp_a -> dp_b x tp_b): a transfer
delivers to every rank of the next stage exactly the rows of the micro-batch its
replica needs, and the gradient goes back the same way. Every replica of the last
stage seeds its loss's backward with ``dp_b`` times its share of the step's loss
(its rows' counted targets over the global batch's, :func:`~oases.runtime.step.step_shares`),
and the DP reduction divides the replicas' sum by the stage's dp; so when dp
changes across a boundary, the returning gradient is multiplied by dp_a / dp_b,
which makes each stage's reduced gradient that of the step's mean loss over all
counted targets.

With ``parallel.overlap_fb`` each B directly followed by an F in a stage's list (the
steady state) runs as one action, the engine interleaving the two micro-batches'
programs (:meth:`~oases.overlap.engines.OasesEngine.backward_forward`); both
receives are waited first and both sends follow the pair (the lists place them so,
:func:`~oases.pipeline.actions.stage_actions`). Only eager-1f1b's warm-up keeps the
pairs from waiting on each other across stages (``python -m oases.schedule --overlap-fb``).

Ordering: all ranks of a stage run the same list, so their TP and DP collectives
match. Each direction of each boundary has its own process group, on which a rank
only sends or only receives, in micro-batch order; so receives posted early cannot
deadlock under NCCL's in-order point-to-point (:mod:`oases.pipeline.cross_mesh`;
``python -m oases.schedule --p2p`` prints each group's op order per stage pair).
Each pending transfer is waited exactly once: a
receive by the action that consumes it, a send at the end of the step (its buffer
is kept alive until then). On CUDA, ``Pending.wait()`` orders the current stream,
on which the consuming F/B runs, after the transfer.

Interleaved 1F1B (``pp_schedule=interleaved-1f1b``, ``parallel.pp_virtual`` = v): rank r
holds the layers of v virtual stages, chunk c being stage c*pp + r of pp*v equal ones
(one model, :meth:`~oases.models.common.CausalLM.keep_chunks`, so the optimizer, the DP
reducer, ZeRO and checkpoints see one set of parameters). Each chunk is run as a model
of its own that shares those modules (:class:`Chunk`: the chunk's view, an engine whose
ZeRO-3 block indices are shifted into the rank's model's, and its random streams:
:class:`~oases.parallel.random.ChunkRNG`, so a chunk draws the dropout masks the stage
of its layers draws at pp*v stages). The links add a wraparound boundary, rank pp-1 to
rank 0, and every chunk's messages across a boundary share that boundary's two groups,
in the order both sides' lists give them (:mod:`oases.pipeline.p2p`). The DP reduction
is armed before the first backward of the last micro-batch: each bucket then launches
on its parameters' last gradient of the step, a chunk's buckets as soon as that chunk's
last backward is done.

Wire dtype: activations and their gradients cross in the compute dtype under autocast
(bf16 under ``train.precision=bf16``, :func:`~oases.parallel.wire.wire_dtype`, chosen
once per step from ``amp``, alike on both ends since every stage runs the same config),
else in the parameters' dtype. The receiver casts them back to the parameters' dtype:
its stage adds to the residual stream in fp32, and its engine's backward takes the
output's gradient in the output's dtype. So a bf16 run moves half of fp32's bytes
across the boundaries (Megatron-LM's) at the price of one bf16 rounding of the
residual stream, and of the gradient, per boundary; an fp32 run sends and receives
exactly what it did.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from oases.config import Config
from oases.errors import ConfigError
from oases.parallel.batch import documents_in, documents_of
from oases.parallel.engine import AmpFactory, Engine
from oases.parallel.model_view import view_of
from oases.parallel.timing import PIPELINE_LABEL, IntervalTimer, label
from oases.parallel.wgrad import WeightGradStore
from oases.parallel.wire import wire_dtype
from oases.pipeline.actions import is_fused
from oases.pipeline.schedules import VIRTUAL_KINDS, stage_actions
from oases.pipeline.cross_mesh import CrossMeshTransfer, Mesh


def _mesh(stage) -> Mesh:
    return Mesh(stage.first, stage.dp, stage.tp)


@dataclass
class Chunk:
    """One of the virtual stages a rank runs under interleaved-1f1b: the model of its
    layers (sharing the rank's parameters), the engine that runs it (its blocks' ZeRO
    indices shifted into the rank's model's, its tracker for recompute's replay), its
    index, and the rank's :class:`~oases.parallel.random.ChunkRNG`."""
    model: object
    engine: Engine
    index: int
    rng: object

    def random(self):
        """The chunk's random streams, around each of its computes."""
        return self.rng.using(self.index)


class PipelineRunner:
    """Runs this rank's stage of ``ctx.layout`` (its chunks, under interleaved-1f1b).
    Built collectively: every rank builds the transfers of every boundary in the same
    order (they create process groups)."""

    def __init__(self, ctx, *, kind: str, microbatches: int, batch: int, seq: int,
                 d_model: int, method: str = "broadcast", overlap_fb: bool = False,
                 sequence_parallel: bool = False, chunks: Optional[list[Chunk]] = None) -> None:
        """``kind``: the pipeline schedule; ``batch`` x ``seq`` x ``d_model``: one
        micro-batch's activation across the pipeline's DP replicas; ``method``: how a
        boundary's activation is resharded (:mod:`oases.pipeline.cross_mesh`);
        ``sequence_parallel``: a stage's input and output (and their gradients) are each
        TP rank's positions, and cross as such (``CrossMeshTransfer(sharded=True)``).
        ``chunks``: this rank's virtual stages (``kind`` interleaved-1f1b); their links
        add the wraparound boundary from the last rank to the first."""
        layout = ctx.layout
        self.ctx, self.kind, self.n = ctx, kind, microbatches
        self.tail = (d_model,)
        self.chunks = chunks
        self.v = len(chunks) if chunks else 1
        if (kind in VIRTUAL_KINDS) != (chunks is not None):
            raise ConfigError(f"parallel.pp_schedule={kind} with "
                              f"{len(chunks) if chunks else 'no'} chunks per rank: "
                              f"interleaved-1f1b and only it runs a model built in chunks "
                              f"(parallel.pp_virtual)")
        self.recv_f = self.send_f = self.recv_b = self.send_b = None
        # each direction of each boundary: its own p2p group; boundary b joins rank b to
        # rank (b + 1) mod pp, the last one (the wraparound) only with chunks
        for b in range(layout.pp if chunks else layout.pp - 1):
            nb = (b + 1) % layout.pp
            src, dst = _mesh(layout.stages[b]), _mesh(layout.stages[nb])
            fwd = CrossMeshTransfer(src, dst, batch, seq, method, sharded=sequence_parallel)
            bwd = CrossMeshTransfer(dst, src, batch, seq, method, sharded=sequence_parallel)
            if ctx.stage == b:
                self.send_f, self.recv_b = fwd, bwd
            if ctx.stage == nb:
                self.recv_f, self.send_b = fwd, bwd
        # see the module docstring: dp_a / dp_b, for every chunk before the last stage
        self.grad_scale = ctx.dp / layout.stages[(ctx.stage + 1) % layout.pp].dp
        self.overlap_fb = overlap_fb
        self.actions = stage_actions(kind, layout.pp, ctx.stage, microbatches, overlap_fb,
                                     self.v)

    @classmethod
    def from_config(cls, ctx, cfg: Config, chunks: Optional[list[Chunk]] = None
                    ) -> "PipelineRunner":
        """The runner of a validated run config on this rank's stage of ``ctx.layout``."""
        return cls(ctx, kind=cfg.parallel.pp_schedule, microbatches=cfg.train.grad_accum,
                   # under cp a rank's activations are (rows, seq / cp, d): the stages' meshes
                   # are alike, so cp rank c of a replica sends to cp rank c
                   batch=cfg.pipeline_batch * ctx.cp, seq=cfg.model.seq_len // ctx.cp,
                   d_model=cfg.model.d_model,
                   method=cfg.parallel.pp_transfer, overlap_fb=cfg.parallel.overlap_fb,
                   sequence_parallel=cfg.parallel.sequence_parallel, chunks=chunks)

    def is_first(self, chunk: int) -> bool:
        """Whether this rank's ``chunk`` is the pipeline's first (virtual) stage."""
        return self.ctx.is_first_stage and chunk == 0

    def is_last(self, chunk: int) -> bool:
        return self.ctx.is_last_stage and chunk == self.v - 1

    def _runs(self, engine: Engine, model, chunk: int):
        """(engine, model, random streams' context) of ``chunk``."""
        if self.chunks is None:
            return engine, model, contextlib.nullcontext()
        ch = self.chunks[chunk]
        return ch.engine, ch.model, ch.random()

    def step(self, engine: Engine, model, batches: list, scales: list[float], amp: AmpFactory,
             before_last_backward: Callable[[], None] = lambda: None):
        """Forward and backward of every micro-batch of one step (``batches``: this rank's
        ``(x, y)`` of each micro-batch; a stage reads only what it needs). Micro-batch
        ``m``'s loss gradient is seeded with ``scales[m]``. Returns (on the last stage each
        micro-batch's mean loss over this replica's rows, in order, else None; the time
        spent in F/B compute, for the bubble fraction: an IntervalTimer on the device's
        timeline, read once the step is done). Gradients accumulate into ``.grad``.
        Each action and each wait for a transfer is a profiler range (``pp F3``,
        ``pp wait B1``: the "pipeline" lane of :mod:`oases.overlap.trace`; ``F3c1`` on
        chunk 1). ``before_last_backward`` runs before the first backward of the last
        micro-batch (on any chunk): the DP reduction is armed there, and launches each
        bucket on its parameters' last gradient of the step."""
        ctx, dev = self.ctx, self.ctx.device
        local = next(model.parameters()).dtype  # what the stage's code computes on
        wire = wire_dtype(amp, dev, local)      # what crosses (the module docstring)
        recvs: dict = {}
        sends: list = []
        runs: dict = {}
        grads_in: dict = {}
        losses: dict = {}
        last_b = min(i for i, a in enumerate(self.actions)
                     if a.kind == "B" and a.mb == self.n - 1)
        busy = IntervalTimer(dev)  # a host clock would time the launches on CUDA
        store = self._weight_grads(model)  # zero-bubble: B defers dW to W
        deferred: dict = {}

        def split_b(m):  # B(m) without its weight gradients, when a W(m) follows
            if store is None:
                return contextlib.nullcontext()
            return store.deferring()

        def inputs_f(m, c):
            x, y = batches[m]
            if self.is_first(c):
                inp = x.to(dev)
            else:
                with _span(f"wait F{_name(m, c)}"):
                    inp = recvs.pop(("F", m, c)).wait().to(local)
            # every stage holds the micro-batch's rows, so its documents too
            docs = documents_of(batches[m])
            return inp, (y.to(dev) if self.is_last(c) else None), \
                (None if docs is None else docs.to(dev))

        def grad_b(m, c):
            if self.is_last(c):
                return None
            with _span(f"wait B{_name(m, c)}"):
                g = recvs.pop(("B", m, c)).wait().to(local)
            return g * self.grad_scale if self.grad_scale != 1.0 else g

        fused_f = None  # the F that ran fused with the B before it
        for i, a in enumerate(self.actions):
            m, c = a.mb, a.chunk
            key, name = (m, c), _name(m, c)
            if a.kind == "RECV_F":
                recvs[("F", m, c)] = self.recv_f.recv(self.tail, wire, dev)
            elif a.kind == "RECV_B":
                recvs[("B", m, c)] = self.recv_b.recv(self.tail, wire, dev)
            elif a.kind == "SEND_F":
                sends.append(self.send_f.send(runs[key].output.to(wire).contiguous()))
            elif a.kind == "SEND_B":
                sends.append(self.send_b.send(grads_in.pop(key).to(wire).contiguous()))
            elif a.kind == "F" and i == fused_f:
                continue
            elif a.kind == "F":
                inp, tgt, docs = inputs_f(m, c)
                eng, mod, rng = self._runs(engine, model, c)
                t0 = busy.start()
                with _span(f"F{name}"), rng:
                    runs[key] = eng.forward(mod, inp, tgt, amp, docs)
                busy.stop(t0)
                if self.is_last(c):
                    losses[m] = runs[key].loss
            elif self.overlap_fb and is_fused(self.actions, i):
                # B(m) and the F after it as one interleaved program (both inputs first);
                # one chunk only: the schema refuses overlap_fb with interleaved-1f1b
                k = self.actions[i + 1].mb
                g = grad_b(m, 0)
                inp, tgt, docs = inputs_f(k, 0)
                t0 = busy.start()
                with _span(f"B{m}+F{k}"), split_b(m) as rec:
                    gin, runs[(k, 0)] = engine.backward_forward(
                        runs.pop(key), g, scales[m], model, inp, tgt, amp, docs)
                busy.stop(t0)
                deferred[m] = rec
                fused_f = i + 1
                if self.is_last(0):
                    losses[k] = runs[(k, 0)].loss
                if not self.is_first(0):
                    grads_in[key] = gin
            elif a.kind == "W":  # no communication: the schedule put it in the bubble
                t0 = busy.start()
                with _span(f"W{m}"):
                    WeightGradStore.apply(deferred.pop(m))
                busy.stop(t0)
            else:  # B
                g = grad_b(m, c)
                if i == last_b:
                    before_last_backward()
                eng, _, rng = self._runs(engine, model, c)
                t0 = busy.start()
                with _span(f"B{name}"), split_b(m) as rec, rng:
                    gin = eng.backward(runs.pop(key), g, scales[m], amp)
                busy.stop(t0)
                deferred[m] = rec
                if not self.is_first(c):
                    grads_in[key] = gin
        with _span("wait sends"):
            for s in sends:  # the buffers were kept alive until now
                s.wait()
        left = [m for m, rec in deferred.items() if rec]
        if recvs or runs or left:  # a schedule that the checker let through leaves nothing
            raise RuntimeError(f"pipeline step left {sorted(recvs)} received, "
                               f"{sorted(runs)} forwarded and {left} without their W")
        return ([losses[m] for m in range(self.n)] if ctx.is_last_stage else None), busy

    def _weight_grads(self, model):
        """The model's WeightGradStore when this stage's actions hold W's, else None."""
        if not any(a.kind == "W" for a in self.actions):
            return None
        store = view_of(model).wgrad
        if store is None:
            raise RuntimeError(f"pp_schedule {self.kind} runs W actions but the model's "
                               f"weight gradients are not deferrable (build it with "
                               f"Parallelism(defer_weight_grads=True))")
        return store

    @torch.no_grad()
    def forward_only(self, model, x: torch.Tensor, y: torch.Tensor, amp: AmpFactory,
                     docs=None):
        """One micro-batch through the stages (every chunk, in order), no backward
        (evaluation): the last stage returns its mean loss over this replica's counted
        targets, the others None. ``docs``: its documents (the model's slot holds them
        for the forward)."""
        ctx, dev = self.ctx, self.ctx.device
        local = next(model.parameters()).dtype
        wire = wire_dtype(amp, dev, local)  # as in step
        out = None
        for c in range(self.v):
            mod = model if self.chunks is None else self.chunks[c].model
            inp = (x.to(dev) if self.is_first(c)
                   else self.recv_f.recv(self.tail, wire, dev).wait().to(local))
            with amp(), documents_in(mod, None if docs is None else docs.to(dev)):
                out = mod(inp, y.to(dev) if self.is_last(c) else None)
            if not self.is_last(c):
                self.send_f.send(out.to(wire).contiguous()).wait()
        return out.float() if ctx.is_last_stage else None


def _name(m: int, c: int) -> str:
    return f"{m}c{c}" if c else f"{m}"


def _span(name: str):
    return label(PIPELINE_LABEL + name)
