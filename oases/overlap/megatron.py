"""The ``megatron`` engine: plain autograd over a micro-batch (or a pipeline stage's
forward and backward actions). It and the ``oases`` engine are
:class:`~oases.parallel.engine.Engine` s.

Every row-parallel output is all-reduced in place and waited for (blocking); in
backward the column-parallel input gradient is all-reduced while the weight
gradient is computed (as Megatron-LM does). Recompute (``full``) lives in the model.

The backward is autograd's: on CUDA it runs on autograd's device thread, and what it
communicates goes out in the comm scope of the forward (the TP functions, the recompute
re-run, the DP reducer's and ZeRO-3 store's hooks each carry theirs,
:class:`~oases.parallel.comm.CommScope`). Each wait orders the current stream: the step
runs on the default stream (:func:`~oases.parallel.comm.require_default_stream`).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn as nn

from oases.overlap.memory import SavedTensorMeter
from oases.overlap.trace import engine_span
from oases.parallel.comm import require_default_stream
from oases.parallel.engine import AmpFactory, StageRun

__all__ = ["AmpFactory", "MegatronSchedule", "StageRun"]


class MegatronSchedule:
    """Plain autograd over the whole micro-batch (recompute=full lives in the model)."""

    name = "megatron"
    pairs = False  # backward_forward runs its two passes in turn

    def __init__(self, tracer=None) -> None:
        self.tracer = tracer

    def _span(self, name: str):
        return engine_span(self.tracer, name)

    def forward_backward(self, model: nn.Module, ids: torch.Tensor, targets: torch.Tensor,
                         scale: float = 1.0, amp: AmpFactory = contextlib.nullcontext) -> torch.Tensor:
        require_default_stream(ids.device, "the megatron engine")
        with self._span("forward"), amp():
            loss = model(ids, targets)
        SavedTensorMeter.end_of_forward()
        with self._span("backward"):
            (loss * scale).backward()
        return loss.detach()

    # -- a pipeline stage: forward and backward of a micro-batch as separate actions --
    def forward(self, model: nn.Module, inp: torch.Tensor, targets: Optional[torch.Tensor],
                amp: AmpFactory = contextlib.nullcontext) -> StageRun:
        """Forward of one micro-batch on a pipeline stage: ``inp`` is token ids (first
        stage) or the previous stage's activation; the run holds the loss (last stage)
        or the output activation, and the graph until :meth:`backward`."""
        require_default_stream(inp.device, "the megatron engine")
        x = _stage_input(inp)
        with self._span("forward"), amp():
            out = model(x, targets)
        last = targets is not None
        return StageRun(state=(x, out), loss=out.detach() if last else None,
                        output=None if last else out.detach())

    def backward(self, run: StageRun, grad: Optional[torch.Tensor], scale: float = 1.0,
                 amp: AmpFactory = contextlib.nullcontext) -> Optional[torch.Tensor]:
        """Backward of a :meth:`forward` run: from the loss (``grad`` None, scaled by
        ``scale``) or from the gradient of the output; returns the input's gradient
        (None on the first stage)."""
        x, out = run.state
        run.state = None
        with self._span("backward"):
            if grad is None:
                (out * scale).backward()
            else:
                out.backward(grad)
        return x.grad if x.is_floating_point() else None

    def backward_forward(self, run: StageRun, grad: Optional[torch.Tensor], scale: float,
                         model: nn.Module, inp: torch.Tensor, targets: Optional[torch.Tensor],
                         amp: AmpFactory = contextlib.nullcontext):
        """:meth:`backward` of ``run``, then :meth:`forward` of the next micro-batch:
        plain autograd has no collectives of its own to interleave."""
        return self.backward(run, grad, scale, amp), self.forward(model, inp, targets, amp)


def _stage_input(inp: torch.Tensor) -> torch.Tensor:
    """Token ids pass as they are; an activation from the previous stage becomes a leaf
    whose gradient is what the stage sends back."""
    return inp.detach().requires_grad_() if inp.is_floating_point() else inp
