"""A micro-batch as the data loaders hand it over: token ids, next-token targets and,
for packed documents, where each document starts."""

from __future__ import annotations

import contextlib
from typing import ContextManager, Optional

import torch
import torch.nn as nn

from oases.parallel.model_view import view_of


class Batch(tuple):
    """``(x, y)``: (B, T) int64 token ids and targets (``IGNORE_INDEX`` where a target
    does not count), unpacking as the pair; ``docs``: the rows'
    :class:`~oases.models.documents.Documents` (None: one document per row), which the
    engines put in the model's document slot for the rows they compute."""

    docs: Optional[object]

    def __new__(cls, x: torch.Tensor, y: torch.Tensor, docs: Optional[object] = None) -> "Batch":
        b = super().__new__(cls, (x, y))
        b.docs = docs
        return b

    def to(self, device, non_blocking: bool = False) -> "Batch":
        x, y = self
        docs = None if self.docs is None else self.docs.to(device, non_blocking=non_blocking)
        return Batch(x.to(device, non_blocking=non_blocking),
                     y.to(device, non_blocking=non_blocking), docs)


def documents_of(batch) -> Optional[object]:
    """A batch's documents: a :class:`Batch`'s ``docs``, None for a plain ``(x, y)``."""
    return batch.docs if isinstance(batch, Batch) else None
def documents_in(model: nn.Module, docs) -> ContextManager:
    """``docs`` (a micro-batch's :class:`~oases.models.documents.Documents`, or None) in
    ``model``'s document slot while the block runs: the attention and the positions of
    every layer read them (:mod:`oases.models.documents`). A model without a slot takes
    no documents."""
    slot = view_of(model).documents
    if slot is None:
        if docs is not None:
            raise ValueError(f"{type(model).__name__} has no document slot (`documents`): "
                             f"it cannot keep attention inside packed documents")
        return contextlib.nullcontext()
    return slot.use(docs)

