"""The pipeline runtime: one rank's stage runs its action list for one optimizer step.

Each stage's action list comes from :mod:`oases.pipeline.actions` (gpipe, 1f1b,
eager-1f1b). An ``F``/``B`` action runs the stage's blocks through the engine
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
from typing import Callable

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


class PipelineRunner:
    """Runs this rank's stage of ``ctx.layout``. Built collectively: every rank builds
    the transfers of every boundary in the same order (they create process groups)."""

    def __init__(self, ctx, *, kind: str, microbatches: int, batch: int, seq: int,
                 d_model: int, method: str = "broadcast", overlap_fb: bool = False,
                 sequence_parallel: bool = False) -> None:
        """``kind``: the pipeline schedule; ``batch`` x ``seq`` x ``d_model``: one
        micro-batch's activation across the pipeline's DP replicas; ``method``: how a
        boundary's activation is resharded (:mod:`oases.pipeline.cross_mesh`);
        ``sequence_parallel``: a stage's input and output (and their gradients) are each
        TP rank's positions, and cross as such (``CrossMeshTransfer(sharded=True)``)."""
        layout = ctx.layout
        self.ctx, self.kind, self.n = ctx, kind, microbatches
        self.tail = (d_model,)
        self.recv_f = self.send_f = self.recv_b = self.send_b = None
        for b in range(layout.pp - 1):  # each direction of each boundary: its own p2p group
            src, dst = _mesh(layout.stages[b]), _mesh(layout.stages[b + 1])
            fwd = CrossMeshTransfer(src, dst, batch, seq, method, sharded=sequence_parallel)
            bwd = CrossMeshTransfer(dst, src, batch, seq, method, sharded=sequence_parallel)
            if ctx.stage == b:
                self.send_f, self.recv_b = fwd, bwd
            elif ctx.stage == b + 1:
                self.recv_f, self.send_b = fwd, bwd
        self.grad_scale = 1.0
        if ctx.stage < layout.pp - 1:  # see the module docstring: dp_a / dp_b
            self.grad_scale = ctx.dp / layout.stages[ctx.stage + 1].dp
        self.overlap_fb = overlap_fb
        if kind in VIRTUAL_KINDS:  # a rank would hold several stages' layers and links
            raise ConfigError(f"parallel.pp_schedule={kind}: the runtime does not run "
                              f"virtual stages yet (python -m oases.schedule --kind {kind} "
                              f"--virtual 2 prints and simulates it); use zb-h1 or "
                              f"eager-zb-h1 to shrink the bubble")
        self.actions = stage_actions(kind, layout.pp, ctx.stage, microbatches, overlap_fb)

    @classmethod
    def from_config(cls, ctx, cfg: Config) -> "PipelineRunner":
        """The runner of a validated run config on this rank's stage of ``ctx.layout``."""
        return cls(ctx, kind=cfg.parallel.pp_schedule, microbatches=cfg.train.grad_accum,
                   batch=cfg.pipeline_batch, seq=cfg.model.seq_len, d_model=cfg.model.d_model,
                   method=cfg.parallel.pp_transfer, overlap_fb=cfg.parallel.overlap_fb,
                   sequence_parallel=cfg.parallel.sequence_parallel)

    def step(self, engine: Engine, model, batches: list, scales: list[float], amp: AmpFactory,
             before_last_backward: Callable[[], None] = lambda: None):
        """Forward and backward of every micro-batch of one step (``batches``: this rank's
        ``(x, y)`` of each micro-batch; a stage reads only what it needs). Micro-batch
        ``m``'s loss gradient is seeded with ``scales[m]``. Returns (on the last stage each
        micro-batch's mean loss over this replica's rows, in order, else None; the time
        spent in F/B compute, for the bubble fraction: an IntervalTimer on the device's
        timeline, read once the step is done). Gradients accumulate into ``.grad``.
        Each action and each wait for a transfer is a profiler range (``pp F3``,
        ``pp wait B1``: the "pipeline" lane of :mod:`oases.overlap.trace`)."""
        ctx, dev = self.ctx, self.ctx.device
        local = next(model.parameters()).dtype  # what the stage's code computes on
        wire = wire_dtype(amp, dev, local)      # what crosses (the module docstring)
        recvs: dict = {}
        sends: list = []
        runs: dict = {}
        grads_in: dict = {}
        losses: dict = {}
        last_b = max(i for i, a in enumerate(self.actions) if a.kind == "B")
        busy = IntervalTimer(dev)  # a host clock would time the launches on CUDA
        store = self._weight_grads(model)  # zero-bubble: B defers dW to W
        deferred: dict = {}

        def split_b(m):  # B(m) without its weight gradients, when a W(m) follows
            if store is None:
                return contextlib.nullcontext()
            return store.deferring()

        def inputs_f(m):
            x, y = batches[m]
            if ctx.is_first_stage:
                inp = x.to(dev)
            else:
                with _span(f"wait F{m}"):
                    inp = recvs.pop(("F", m)).wait().to(local)
            # every stage holds the micro-batch's rows, so its documents too
            docs = documents_of(batches[m])
            return inp, (y.to(dev) if ctx.is_last_stage else None), \
                (None if docs is None else docs.to(dev))

        def grad_b(m):
            if ctx.is_last_stage:
                return None
            with _span(f"wait B{m}"):
                g = recvs.pop(("B", m)).wait().to(local)
            return g * self.grad_scale if self.grad_scale != 1.0 else g

        fused_f = None  # the F that ran fused with the B before it
        for i, a in enumerate(self.actions):
            m = a.mb
            if a.kind == "RECV_F":
                recvs[("F", m)] = self.recv_f.recv(self.tail, wire, dev)
            elif a.kind == "RECV_B":
                recvs[("B", m)] = self.recv_b.recv(self.tail, wire, dev)
            elif a.kind == "SEND_F":
                sends.append(self.send_f.send(runs[m].output.to(wire).contiguous()))
            elif a.kind == "SEND_B":
                sends.append(self.send_b.send(grads_in.pop(m).to(wire).contiguous()))
            elif a.kind == "F" and i == fused_f:
                continue
            elif a.kind == "F":
                inp, tgt, docs = inputs_f(m)
                t0 = busy.start()
                with _span(f"F{m}"):
                    runs[m] = engine.forward(model, inp, tgt, amp, docs)
                busy.stop(t0)
                if ctx.is_last_stage:
                    losses[m] = runs[m].loss
            elif self.overlap_fb and is_fused(self.actions, i):
                # B(m) and the F after it as one interleaved program (both inputs first)
                k = self.actions[i + 1].mb
                g = grad_b(m)
                inp, tgt, docs = inputs_f(k)
                t0 = busy.start()
                with _span(f"B{m}+F{k}"), split_b(m) as rec:
                    gin, runs[k] = engine.backward_forward(runs.pop(m), g, scales[m], model,
                                                           inp, tgt, amp, docs)
                busy.stop(t0)
                deferred[m] = rec
                fused_f = i + 1
                if ctx.is_last_stage:
                    losses[k] = runs[k].loss
                if not ctx.is_first_stage:
                    grads_in[m] = gin
            elif a.kind == "W":  # no communication: the schedule put it in the bubble
                t0 = busy.start()
                with _span(f"W{m}"):
                    WeightGradStore.apply(deferred.pop(m))
                busy.stop(t0)
            else:  # B
                g = grad_b(m)
                if i == last_b:
                    before_last_backward()
                t0 = busy.start()
                with _span(f"B{m}"), split_b(m) as rec:
                    gin = engine.backward(runs.pop(m), g, scales[m], amp)
                busy.stop(t0)
                deferred[m] = rec
                if not ctx.is_first_stage:
                    grads_in[m] = gin
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
        """One micro-batch through the stages, no backward (evaluation): the last stage
        returns its mean loss over this replica's counted targets, the others None.
        ``docs``: its documents (the model's slot holds them for the forward)."""
        ctx, dev = self.ctx, self.ctx.device
        local = next(model.parameters()).dtype
        wire = wire_dtype(amp, dev, local)  # as in step
        inp = (x.to(dev) if ctx.is_first_stage
               else self.recv_f.recv(self.tail, wire, dev).wait().to(local))
        with amp(), documents_in(model, None if docs is None else docs.to(dev)):
            out = model(inp, y.to(dev) if ctx.is_last_stage else None)
        if ctx.is_last_stage:
            return out.float()
        self.send_f.send(out.to(wire).contiguous()).wait()
        return None


def _span(name: str):
    return label(PIPELINE_LABEL + name)
