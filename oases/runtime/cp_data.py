"""A data loader's batches as a context-parallel rank computes them.

Under ``parallel.cp`` = N the cp ranks of a data replica read the same rows (the loader
is built for the data replica: :attr:`~oases.parallel.groups.ParallelContext.data_rank`
of :attr:`~oases.parallel.groups.ParallelContext.data_dp`) and each keeps its two
head-tail chunks of every row's ids and targets
(:func:`oases.parallel.cp_chunks.shard_sequence`). The rows' documents stay whole: the
ring reads every block's document numbers from them, and positions restart at the
whole row's documents (:class:`oases.models.documents.DocumentSlot`)."""

from __future__ import annotations

from typing import Iterator

from oases.parallel.batch import Batch, documents_of
from oases.parallel.cp_chunks import shard_sequence

__all__ = ["CpShards", "cp_shard"]


def cp_shard(batch, cp: int, rank: int) -> Batch:
    """``batch`` (``(x, y)`` of whole rows, with their documents) as cp rank ``rank``
    computes it: its chunks of x and y, the documents whole."""
    x, y = batch
    return Batch(shard_sequence(x, cp, rank, dim=1), shard_sequence(y, cp, rank, dim=1),
                 documents_of(batch))


class CpShards:
    """A :class:`~oases.runtime.data.TrainBatches` or
    :class:`~oases.runtime.data.ValBatches` whose batches come out as cp rank ``rank``'s
    (:func:`cp_shard`); everything else (position, state, counts) is the loader's."""

    def __init__(self, inner, cp: int, rank: int) -> None:
        self.inner, self.cp, self.rank = inner, cp, rank

    def next_batch(self) -> Batch:
        return cp_shard(self.inner.next_batch(), self.cp, self.rank)

    def __iter__(self) -> Iterator[Batch]:
        for b in self.inner:
            yield cp_shard(b, self.cp, self.rank)

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str):
        if name == "inner":  # not yet set (copying, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)
