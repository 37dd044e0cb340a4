"""The engines' view of a model, written down: what the TP engines (:mod:`oases.overlap`),
the step's loss weighing and the DP reducer (:mod:`oases.dp`) may ask of it.

:class:`EngineModel` is the whole protocol; :class:`oases.models.common.CausalLM`
implements all of it. A model of one's own needs only the two required members,
``blocks()`` and ``loss_from_hidden()`` (docs/custom-blocks.md); :func:`view_of` resolves
the optional ones once per model, with their defaults, so no engine probes a model with
``hasattr``/``getattr`` of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Union

import torch
import torch.nn as nn

Count = Union[int, torch.Tensor]


class EngineModel(Protocol):
    """A model an engine runs. Required: :meth:`blocks`, :meth:`loss_from_hidden`. The
    rest is optional (:class:`ModelView` says each default)."""

    def blocks(self) -> list[nn.Module]:
        """Every :class:`~oases.parallel.block.TPBlock` in execution order; the first takes
        the raw input."""
        ...

    def loss_from_hidden(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss from the last block's output."""
        ...

    # -- optional --
    tp_group: Optional[object]
    """The group of the loss's collective and of the parameters outside every block."""
    home_degree: int
    """The TP degree of the model's input and output (blocks of a plan may differ)."""
    sequence_parallel: bool
    """Activations between blocks are sharded along the sequence."""
    documents: object
    """Its :class:`~oases.models.documents.DocumentSlot`: the documents of the rows the
    blocks compute now, which the engines fill (``use(docs)``) for packed batches."""
    wgrad: object
    """Its :class:`~oases.parallel.wgrad.WeightGradStore` when its blocks' weight gradients
    may be deferred (zero-bubble pipelines), else None."""
    cp_group: Optional[object]
    """Context parallelism's group: its blocks' ring attention exchanges over it."""
    chunks: Optional[list]
    """Interleaved pipelines: a model per virtual stage this rank runs, sharing this
    one's blocks (each an :class:`EngineModel`), else None."""

    def recompute_groups(self) -> list[tuple[int, int]]:
        """Block ranges [a, b) recomputed together under recompute=full."""
        ...

    def loss_partial(self, x: torch.Tensor, targets: torch.Tensor) -> tuple[object, torch.Tensor]:
        """The loss up to its one all-reduce: (state, the buffer to reduce over tp_group)."""
        ...

    def loss_combine(self, state: object, reduced: torch.Tensor) -> torch.Tensor:
        """The loss after that all-reduce."""
        ...

    def loss_tokens(self, targets: torch.Tensor) -> Count:
        """How many terms the mean loss over ``targets`` averages."""
        ...


@dataclass(frozen=True)
class ModelView:
    """One model's optional members, resolved (:func:`view_of`). Defaults for a model that
    lacks them: every block recomputed alone, the first block's TP group and degree,
    no sequence parallelism, the loss computed whole (its collective not scheduled by the
    engine), and each loss one term (batches weighed alike)."""
    tp_group: Optional[object]
    home_degree: Optional[int]          # None: the degree of blocks()[0]
    sequence_parallel: bool
    recompute_groups: Optional[Callable[[], list[tuple[int, int]]]]
    loss_partial: Optional[Callable]
    loss_combine: Optional[Callable]
    loss_tokens: Optional[Callable[[torch.Tensor], Count]]
    documents: Optional[object] = None  # None: the model takes no documents
    wgrad: Optional[object] = None      # None: weight gradients computed in backward
    chunks: Optional[list] = None       # None: one stage (or the whole model)
    cp_group: Optional[object] = None   # None: no context parallelism

    @property
    def split_loss(self) -> bool:
        """The loss comes in two parts around its all-reduce (the engine schedules it)."""
        return self.loss_partial is not None and self.loss_combine is not None

    def groups(self, n_blocks: int, first: int) -> list[tuple[int, int]]:
        """Recompute ranges; by default each block from ``first`` on alone."""
        if self.recompute_groups is not None:
            return self.recompute_groups()
        return [(i, i + 1) for i in range(first, n_blocks)]

    def home(self, blocks: list) -> int:
        return self.home_degree if self.home_degree is not None else blocks[0].degree

    def count(self, targets: torch.Tensor) -> Count:
        """:meth:`EngineModel.loss_tokens`, or 1."""
        return 1 if self.loss_tokens is None else self.loss_tokens(targets)


def view_of(model: EngineModel) -> ModelView:
    """``model``'s :class:`ModelView`: the one place a model's optional members are looked
    up (a handful of attribute reads, cheap enough for every micro-batch, and never stale
    when a member changes, as ``set_sequence_parallel`` does)."""
    return ModelView(
        tp_group=getattr(model, "tp_group", None),
        home_degree=getattr(model, "home_degree", None),
        sequence_parallel=bool(getattr(model, "sequence_parallel", False)),
        recompute_groups=getattr(model, "recompute_groups", None),
        loss_partial=getattr(model, "loss_partial", None),
        loss_combine=getattr(model, "loss_combine", None),
        loss_tokens=getattr(model, "loss_tokens", None),
        documents=getattr(model, "documents", None),
        wgrad=getattr(model, "wgrad", None),
        chunks=getattr(model, "chunks", None),
        cp_group=getattr(model, "cp_group", None))
