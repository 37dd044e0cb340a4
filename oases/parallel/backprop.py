"""Backward from tensors whose gradients a schedule made itself, without the per-call
checks of ``torch.autograd.backward``.

The ``oases`` engine runs a backward per block and per cut, per sub-batch: several per
block per step. ``torch.autograd.backward`` first validates every gradient against its
tensor in Python (``_make_grads``: symbolic-shape comparisons, dtype checks), about 20 us
a call on a CPU core, as much as a small segment's kernels take on a GPU. The engine's
gradients are the all-reduced gradients of the very tensors they are fed back to (or
``ones_like`` a loss): their shapes match by construction. :func:`backward` checks the
shapes itself (a tuple comparison) and calls autograd's engine as
``torch.autograd.backward`` does after its checks (``torch.autograd.graph``'s runner,
which also hands the context that compiled regions read to autograd's device threads);
anything else, and a torch without that runner, takes ``torch.autograd.backward``.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch
import torch.autograd.graph as graph

_RUN = getattr(graph, "_engine_run_backward", None)

Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]


def backward(tensors: Tensors, grads: Tensors) -> None:
    """``torch.autograd.backward(tensors, grads)``: accumulates into the leaves' ``.grad``
    and frees the graph."""
    if isinstance(tensors, torch.Tensor):
        tensors, grads = (tensors,), (grads,)
    else:
        tensors, grads = tuple(tensors), tuple(grads)
    if _RUN is None or len(tensors) != len(grads) or any(
            not isinstance(g, torch.Tensor) or t.shape != g.shape or t.dtype.is_complex
            for t, g in zip(tensors, grads)):
        torch.autograd.backward(tensors, grads)
        return
    _RUN(tensors, grads, False, False, (), allow_unreachable=True, accumulate_grad=True)
