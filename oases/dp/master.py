"""bf16 compute weights over fp32 master weights (``train.precision=bf16``).

The model holds its parameters in the compute dtype (bf16: half the bytes on the
device, in every gather and every post-step broadcast); the optimizer steps fp32
*master* copies, and gradients accumulate in fp32 *main-grad* buffers, as Megatron
does:

    parameter p      bf16, what forward, recompute and backward read
    p.main_grad      fp32, a view into the reducer's bucket buffer: each bf16 gradient
                     autograd accumulates into p.grad is added here (a post-accumulate
                     hook, :meth:`~oases.dp.reducer.GradReducer`) and p.grad is dropped
    master           fp32; the optimizer's tensor (its ``.grad`` is the main-grad view),
                     checkpoints write and read it; after each step (and each load) the
                     parameters are the master rounded to bf16

Where the master lives depends on the bucket's ZeRO level: a level-0 bucket keeps a
whole fp32 flat (:class:`MasterCopy`); at levels 1-3 the owned range of
:class:`~oases.dp.zero.ShardedFlat` is the master (``master=True``), and the post-step
gathers of levels 1 and 2, like level 3's gathers, move bf16.

Readers of gradients go through :func:`grad_of`: the main-grad where a parameter has
one, else ``.grad``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn


def grad_of(p: torch.Tensor) -> Optional[torch.Tensor]:
    """The gradient the reducer, clipping and the optimizer see: ``p.main_grad`` (fp32,
    under bf16 compute weights), else ``p.grad``."""
    g = getattr(p, "main_grad", None)
    return g if g is not None else p.grad


def accumulate_main_grad(p: torch.Tensor) -> None:
    """A post-accumulate hook's work: the bf16 gradient autograd just accumulated goes
    into the fp32 main-grad, and ``p.grad`` is dropped (the next accumulation starts a
    new one, so the hook fires once per accumulation, as without a main-grad)."""
    g = p.grad
    if g is not None:
        p.main_grad.add_(g)
        p.grad = None


class MasterCopy:
    """A level-0 bucket's fp32 master weights: ``master`` a flat copy of its parameters'
    values, the parameters becoming views into a flat of ``dtype`` (the compute dtype),
    and ``pairs`` the (master view, parameter) the optimizer steps, each master view's
    ``.grad`` the parameter's main-grad view into ``grads``."""

    def __init__(self, params: list[nn.Parameter], grads: torch.Tensor,
                 dtype: torch.dtype) -> None:
        n = sum(p.numel() for p in params)
        dev = grads.device
        self.master = torch.empty(n, device=dev, dtype=torch.float32)
        self.flat = torch.empty(n, device=dev, dtype=dtype)
        self.pairs: list[tuple[torch.Tensor, nn.Parameter]] = []
        self._grads: list[torch.Tensor] = []
        off = 0
        with torch.no_grad():
            for p in params:
                k = p.numel()
                self.master[off: off + k].copy_(p.data.reshape(-1))
                p.data = self.flat[off: off + k].view_as(p)
                self.pairs.append((self.master[off: off + k].view_as(p), p))
                self._grads.append(grads[off: off + k].view_as(p))
                off += k
            self.flat.copy_(self.master)
        self.attach()

    def attach(self) -> None:
        """Each master's ``.grad`` its main-grad view (again, also if something set it to
        None: ``optimizer.zero_grad()``)."""
        for (m, _), g in zip(self.pairs, self._grads):
            m.grad = g

    def detached(self) -> Optional[nn.Parameter]:
        for (m, p), g in zip(self.pairs, self._grads):
            if m.grad is None or m.grad.data_ptr() != g.data_ptr():
                return p
        return None

    @torch.no_grad()
    def publish(self) -> None:
        """The parameters become the masters rounded to the compute dtype (after a step or
        a load): one cast-copy per bucket, on the current stream."""
        self.flat.copy_(self.master)
