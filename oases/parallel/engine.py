"""What the runtime and the pipeline runner may ask of a schedule engine, and what an
engine may ask of the parameters it runs on.

An :class:`Engine` runs a model's blocks (:mod:`oases.parallel.block`) for one
micro-batch. At pp = 1 the step calls :meth:`Engine.forward_backward`; a pipeline
stage runs the forward and the backward of a micro-batch as separate actions
(:meth:`Engine.forward`, later :meth:`Engine.backward`), the engine's state kept in a
:class:`StageRun` in between. An engine whose :attr:`Engine.pairs` is True runs a
backward interleaved with the next micro-batch's forward
(:meth:`Engine.backward_forward`, ``parallel.overlap_fb``); for the others that call
is the backward followed by the forward. Both engines live in :mod:`oases.overlap`;
this module is below it so that the pipeline runner and the runtime name the type
without depending on the engines.

:class:`BlockParams` is the one hook an engine reaches parameters through: before a
block's compute starts, or resumes after a wait on a collective (the other sub-batches
ran meanwhile), the engine calls ``use(block, prefetch)``. Under ZeRO-3 the parameter
store (:class:`oases.dp.store.ParamStore`) gathers the block's parameters there;
without it they are always whole (:data:`WHOLE`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional, Protocol

import torch
import torch.nn as nn

AmpFactory = Callable[[], contextlib.AbstractContextManager]

HEAD = -1
"""The block index :meth:`BlockParams.use` takes for the parameters outside every block:
the final norm and the head (with a tied head, the embedding's table too)."""


@dataclass
class StageRun:
    """One micro-batch's forward on a pipeline stage, kept until its backward: the
    engine's own state, and the (detached) loss on the last stage or output elsewhere."""
    state: object
    loss: Optional[torch.Tensor] = None
    output: Optional[torch.Tensor] = None


class Engine(Protocol):
    """A schedule engine (``parallel.schedule``)."""

    name: str
    pairs: bool
    """True: :meth:`backward_forward` interleaves its two passes' collectives with each
    other's compute (``parallel.overlap_fb`` pays off); False: it runs them in turn."""

    def forward_backward(self, model: nn.Module, ids: torch.Tensor, targets: torch.Tensor,
                         scale: float = 1.0, amp: AmpFactory = contextlib.nullcontext,
                         docs=None) -> torch.Tensor:
        """Forward and backward of one whole micro-batch (pp = 1); returns its detached
        loss. Gradients accumulate scaled by ``scale``. ``docs``: the micro-batch's
        :class:`~oases.models.documents.Documents` (None: one document per row), put in
        the model's slot (``documents``) for the rows being computed."""
        ...

    def forward(self, model: nn.Module, inp: torch.Tensor, targets: Optional[torch.Tensor],
                amp: AmpFactory = contextlib.nullcontext, docs=None) -> StageRun:
        """Forward of one micro-batch on a pipeline stage: ``inp`` is token ids (first
        stage) or the previous stage's activation, ``targets`` None before the last;
        ``docs`` as in :meth:`forward_backward`, kept in the run for its backward."""
        ...

    def backward(self, run: StageRun, grad: Optional[torch.Tensor], scale: float = 1.0,
                 amp: AmpFactory = contextlib.nullcontext) -> Optional[torch.Tensor]:
        """Backward of a :meth:`forward` run, from the loss (``grad`` None) or from the
        output's gradient; returns the input's gradient (None on the first stage)."""
        ...

    def backward_forward(self, run: StageRun, grad: Optional[torch.Tensor], scale: float,
                         model: nn.Module, inp: torch.Tensor, targets: Optional[torch.Tensor],
                         amp: AmpFactory = contextlib.nullcontext, docs=None
                         ) -> tuple[Optional[torch.Tensor], StageRun]:
        """:meth:`backward` of ``run`` and :meth:`forward` of the next micro-batch (whose
        documents ``docs`` are); returns what the two return."""
        ...


class BlockParams(Protocol):
    """How an engine makes a block's parameters usable."""

    def use(self, block: int, prefetch: Optional[int] = None) -> None:
        """Block ``block`` (index in ``model.blocks()``, or :data:`HEAD`) is about to
        compute: its parameters must be whole on return. ``prefetch``: the block the
        pass goes to next (its parameters may be fetched meanwhile), None if none."""
        ...

    def two_passes(self) -> ContextManager:
        """Around a backward interleaved with a forward: blocks from both ends of the
        model are in use at once."""
        ...


class WholeParams:
    """Every parameter always whole on this rank: nothing to do."""

    def use(self, block: int, prefetch: Optional[int] = None) -> None:
        pass

    def two_passes(self) -> ContextManager:
        return contextlib.nullcontext()


WHOLE = WholeParams()


class ShiftedParams:
    """The :class:`BlockParams` of one chunk of a model that holds several
    (interleaved-1f1b, :meth:`oases.models.common.CausalLM.chunk`): the engine counts the
    chunk's blocks from 0, the hook the whole model's (``offset`` blocks before them).
    A prefetch past the chunk's last block goes to the head on the last chunk, else
    nowhere: the next chunk this rank runs is not the next in the model."""

    def __init__(self, inner: BlockParams, offset: int, n_blocks: int, last: bool) -> None:
        self.inner, self.offset, self.n, self.last = inner, offset, n_blocks, last

    @classmethod
    def of(cls, inner: BlockParams, model, chunk) -> BlockParams:
        """``inner`` as ``chunk`` (a view sharing ``model``'s blocks) sees it."""
        if inner is WHOLE:
            return WHOLE
        first = chunk.blocks()[0]
        offset = next(i for i, b in enumerate(model.blocks()) if b is first)
        return cls(inner, offset, len(chunk.blocks()), chunk.is_last)

    def _shift(self, block: Optional[int]) -> Optional[int]:
        if block is None or block == HEAD:
            return block
        if 0 <= block < self.n or (block == self.n and self.last):
            return block + self.offset  # the model's head unit follows its last block
        return None

    def use(self, block: int, prefetch: Optional[int] = None) -> None:
        self.inner.use(self._shift(block), self._shift(prefetch))

    def two_passes(self) -> ContextManager:
        return self.inner.two_passes()
