"""The ``megatron`` engine: plain autograd over a micro-batch (or a pipeline stage's
forward and backward actions). It and the ``oases`` engine are
:class:`~oases.parallel.engine.Engine` s.

Every row-parallel output is all-reduced in place and waited for (blocking); in
backward the column-parallel input gradient is all-reduced while the weight
gradient is computed (as Megatron-LM does). Recompute (``full``) lives in the model.

While a ``torch.profiler`` records, the step is labelled ``forward`` and ``backward``
and, inside them, each block of ``model.blocks()`` ``F <i>`` and ``B <i>``
(:class:`BlockLabels`; :mod:`oases.overlap.trace`).

The backward is autograd's: on CUDA it runs on autograd's device thread, and what it
communicates goes out in the comm scope of the forward (the TP functions, the recompute
re-run, the DP reducer's and ZeRO-3 store's hooks each carry theirs,
:class:`~oases.parallel.comm.CommScope`). Each wait orders the current stream: the step
runs on the default stream (:func:`~oases.parallel.comm.require_default_stream`).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Optional

import torch
import torch.nn as nn

from oases.overlap.memory import SavedTensorMeter
from oases.parallel.comm import require_default_stream
from oases.parallel.engine import AmpFactory, StageRun
from oases.parallel.timing import label, profiling

__all__ = ["AmpFactory", "BlockLabels", "MegatronSchedule", "StageRun"]


class BlockLabels:
    """Profiler ranges per block under plain autograd, where no engine code runs between
    blocks: forward hooks put ``F <i>`` around block i's forward, and a hook on its
    output's gradient opens ``B <i>`` when its backward starts; that range ends when the
    next block's backward starts (whose output is block i's input) or at
    :meth:`close`, after the backward. Installed on a model the first time a step runs
    under a profiler; each hook returns at once when none records."""

    _models: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()

    def __init__(self) -> None:
        self._open = None  # the running backward range

    def install(self, model: nn.Module) -> None:
        if model in BlockLabels._models or not hasattr(model, "blocks"):
            return
        BlockLabels._models.add(model)
        for i, blk in enumerate(model.blocks()):
            blk.register_forward_pre_hook(self._enter_forward(i))
            blk.register_forward_hook(self._exit_forward(i))

    @staticmethod
    def _enter_forward(i: int):
        def hook(module, args):
            if profiling():
                module._oases_range = label(f"F {i}")
                module._oases_range.__enter__()
        return hook

    def _exit_forward(self, i: int):
        def hook(module, args, out):
            rng = module.__dict__.pop("_oases_range", None)
            if rng is None:
                return
            rng.__exit__(None, None, None)
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g: self._backward_of(i))
        return hook

    def _backward_of(self, i: int) -> None:
        self.close()
        if profiling():
            self._open = label(f"B {i}")
            self._open.__enter__()

    def close(self) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None


class MegatronSchedule:
    """Plain autograd over the whole micro-batch (recompute=full lives in the model)."""

    name = "megatron"
    pairs = False  # backward_forward runs its two passes in turn

    def __init__(self) -> None:
        self.labels = BlockLabels()

    @contextlib.contextmanager
    def _span(self, name: str, model: Optional[nn.Module] = None):
        if model is not None and profiling():
            self.labels.install(model)
        with label(name):
            try:
                yield
            finally:
                self.labels.close()  # the last block's backward ends inside ``name``

    def forward_backward(self, model: nn.Module, ids: torch.Tensor, targets: torch.Tensor,
                         scale: float = 1.0, amp: AmpFactory = contextlib.nullcontext) -> torch.Tensor:
        require_default_stream(ids.device, "the megatron engine")
        with self._span("forward", model), amp():
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
        with self._span("forward", model), amp():
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
