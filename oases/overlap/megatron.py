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
from typing import Optional

import torch
import torch.nn as nn

from oases.overlap.memory import SavedTensorMeter
from oases.parallel.comm import require_default_stream
from oases.parallel.engine import AmpFactory, StageRun
from oases.parallel.batch import documents_in
from oases.parallel.timing import label, profiling

__all__ = ["AmpFactory", "BlockLabels", "MegatronEngine", "StageRun"]


class BlockLabels:
    """Profiler ranges per block under plain autograd, where no engine code runs between
    blocks. For the length of a labelled pass (:meth:`around`; the recompute inside a
    backward included) while a profiler records, forward hooks put ``F <i>`` around block
    i's forward, and a hook on its output's gradient opens ``B <i>`` when its backward
    starts. That range ends when the next block's backward starts (whose output is block
    i's input), on the same autograd thread, or when that backward pass ends (a callback
    queued on the autograd engine, so on its thread too). The hooks are removed after the
    pass: a step that no profiler records runs none of them."""

    def __init__(self) -> None:
        self._open = None     # the running backward range
        self._queued = False  # its end-of-backward callback is queued

    @contextlib.contextmanager
    def around(self, model: Optional[nn.Module]):
        if model is None or not profiling() or not hasattr(model, "blocks"):
            yield
            return
        handles = []
        for i, blk in enumerate(model.blocks()):
            handles.append(blk.register_forward_pre_hook(self._enter_forward(i)))
            # always: a recompute stopped early by checkpoint still closes its range
            handles.append(blk.register_forward_hook(self._exit_forward(i), always_call=True))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @staticmethod
    def _enter_forward(i: int):
        def hook(module, args):
            stale = module.__dict__.pop("_oases_range", None)
            if stale is not None:
                stale.__exit__(None, None, None)
            module._oases_range = label(f"F {i}")
            module._oases_range.__enter__()
        return hook

    def _exit_forward(self, i: int):
        def hook(module, args, out):
            rng = module.__dict__.pop("_oases_range", None)
            if rng is None:
                return
            rng.__exit__(None, None, None)
            if isinstance(out, (tuple, list)):
                out = next((o for o in out if isinstance(o, torch.Tensor) and o.requires_grad),
                           None)
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g: self._backward_of(i))
        return hook

    def _backward_of(self, i: int) -> None:
        self.close()
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.close)
            self._queued = True
        self._open = label(f"B {i}")
        self._open.__enter__()

    def close(self) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None
        self._queued = False


class MegatronEngine:
    """Plain autograd over the whole micro-batch (recompute=full lives in the model)."""

    name = "megatron"
    pairs = False  # backward_forward runs its two passes in turn

    def __init__(self) -> None:
        self.labels = BlockLabels()

    @contextlib.contextmanager
    def _span(self, name: str, model: Optional[nn.Module]):
        with label(name), self.labels.around(model):
            yield

    def forward_backward(self, model: nn.Module, ids: torch.Tensor, targets: torch.Tensor,
                         scale: float = 1.0, amp: AmpFactory = contextlib.nullcontext,
                         docs=None) -> torch.Tensor:
        require_default_stream(ids.device, "the megatron engine")
        with documents_in(model, docs):  # the backward's recompute reads them too
            with self._span("forward", model), amp():
                loss = model(ids, targets)
            SavedTensorMeter.end_of_forward()
            with self._span("backward", model):
                (loss * scale).backward()
        return loss.detach()

    # -- a pipeline stage: forward and backward of a micro-batch as separate actions --
    def forward(self, model: nn.Module, inp: torch.Tensor, targets: Optional[torch.Tensor],
                amp: AmpFactory = contextlib.nullcontext, docs=None) -> StageRun:
        """Forward of one micro-batch on a pipeline stage: ``inp`` is token ids (first
        stage) or the previous stage's activation; the run holds the loss (last stage)
        or the output activation, and the graph until :meth:`backward` (and the
        documents, which a recompute in that backward reads again)."""
        require_default_stream(inp.device, "the megatron engine")
        x = _stage_input(inp)
        with documents_in(model, docs), self._span("forward", model), amp():
            out = model(x, targets)
        last = targets is not None
        return StageRun(state=(x, out, model, docs), loss=out.detach() if last else None,
                        output=None if last else out.detach())

    def backward(self, run: StageRun, grad: Optional[torch.Tensor], scale: float = 1.0,
                 amp: AmpFactory = contextlib.nullcontext) -> Optional[torch.Tensor]:
        """Backward of a :meth:`forward` run: from the loss (``grad`` None, scaled by
        ``scale``) or from the gradient of the output; returns the input's gradient
        (None on the first stage)."""
        x, out, model, docs = run.state
        run.state = None
        with documents_in(model, docs), self._span("backward", model):
            if grad is None:
                (out * scale).backward()
            else:
                out.backward(grad)
        return x.grad if x.is_floating_point() else None

    def backward_forward(self, run: StageRun, grad: Optional[torch.Tensor], scale: float,
                         model: nn.Module, inp: torch.Tensor, targets: Optional[torch.Tensor],
                         amp: AmpFactory = contextlib.nullcontext, docs=None):
        """:meth:`backward` of ``run``, then :meth:`forward` of the next micro-batch:
        plain autograd has no collectives of its own to interleave."""
        return (self.backward(run, grad, scale, amp),
                self.forward(model, inp, targets, amp, docs))


def _stage_input(inp: torch.Tensor) -> torch.Tensor:
    """Token ids pass as they are; an activation from the previous stage becomes a leaf
    whose gradient is what the stage sends back."""
    return inp.detach().requires_grad_() if inp.is_floating_point() else inp
