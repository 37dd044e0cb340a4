"""Documents packed into one sequence: which document each token belongs to, the
attention mask that keeps each document to itself, and the positions that restart at
each document's first token.

A micro-batch's :class:`Documents` travel with its tokens (the data loaders make them:
``data.reset_attention_at_eos`` from the EOS ids, chat data from the boundaries
``oases.prepare --chat`` stores). The engines split them with the rows
(:meth:`Documents.chunk`: the ``oases`` engine's sub-batches) and put the rows being
computed into the model's :class:`DocumentSlot`, which the attention and the
embedding read: around each segment of a sub-batch, as they swap its RNG streams
(:mod:`oases.overlap.runner`), and around a pipeline stage's backward, whose recompute
runs later than its forward (:mod:`oases.overlap.megatron`). What they read is plain
tensors, so compiled segments take them as inputs."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch

from oases.parallel.cp_chunks import global_positions, shard_sequence


class Documents:
    """``doc`` (B, T) int64: a document number per token, non-decreasing along each row
    (equal numbers = one document). ``reset_positions``: positions restart at 0 at
    each document's first token (``data.reset_position_ids``), else run 0..T-1."""

    def __init__(self, doc: torch.Tensor, reset_positions: bool = False) -> None:
        if doc.dim() != 2:
            raise ValueError(f"document numbers are (batch, seq): got shape {tuple(doc.shape)}")
        self.doc = doc
        self.reset_positions = reset_positions
        self._mask: Optional[torch.Tensor] = None
        self._positions: Optional[torch.Tensor] = None

    @classmethod
    def from_eos(cls, ids: torch.Tensor, eos_id: int, reset_positions: bool = False
                 ) -> "Documents":
        """Documents ended by ``eos_id``: an EOS belongs to the document it closes, so
        the token after it starts afresh (as Megatron's ``reset_attention_mask``)."""
        is_eos = (ids == eos_id).long()
        return cls(torch.cumsum(is_eos, dim=1) - is_eos, reset_positions)  # (B, T)

    @classmethod
    def from_starts(cls, starts: torch.Tensor, reset_positions: bool = False) -> "Documents":
        """Documents from (B, T) bool ``starts``: True at each document's first token
        (a row's first token starts one whether marked or not)."""
        return cls(torch.cumsum(starts.long(), dim=1), reset_positions)

    @property
    def shape(self) -> torch.Size:
        return self.doc.shape

    def to(self, device, non_blocking: bool = False) -> "Documents":
        if self.doc.device == torch.device(device):
            return self
        return Documents(self.doc.to(device, non_blocking=non_blocking), self.reset_positions)

    def chunk(self, n: int) -> list["Documents"]:
        """The rows split as ``Tensor.chunk(n)`` splits a batch (the sub-batches)."""
        return [Documents(d, self.reset_positions) for d in self.doc.chunk(n)]

    def mask(self) -> torch.Tensor:
        """(B, 1, T, T) bool: position i attends to j <= i of its own document. Made
        once per Documents (every layer and every recompute reads the same)."""
        if self._mask is None:
            d, T = self.doc, self.doc.shape[1]
            causal = torch.ones(T, T, dtype=torch.bool, device=d.device).tril()
            self._mask = ((d[:, :, None] == d[:, None, :]) & causal)[:, None]
        return self._mask

    def positions(self) -> Optional[torch.Tensor]:
        """(B, T) int64: each token's offset in its document (``reset_positions``), else
        None (positions 0..T-1)."""
        if not self.reset_positions:
            return None
        if self._positions is None:
            d, T = self.doc, self.doc.shape[1]
            t = torch.arange(T, device=d.device).expand_as(d)
            first = torch.ones_like(d, dtype=torch.bool)
            first[:, 1:] = d[:, 1:] != d[:, :-1]
            start = torch.where(first, t, torch.zeros_like(t)).cummax(dim=1).values
            self._positions = t - start
        return self._positions


class DocumentSlot:
    """What the model's attention and embedding read: the documents of the rows being
    computed now (None: one document per row, plain causal attention). One slot per
    model, shared by its layers; the engines fill it with :meth:`use`.

    The slot holds the rows of the stage's home TP degree. A block at a lower degree
    computes a piece of them (its subgroup's rows, :mod:`oases.parallel.reshard`):
    ``pieces(degree)`` says which, (piece index, number of pieces), and
    :meth:`mask`/:meth:`positions` give that piece's.

    Under context parallelism ``cp`` is (cp degree, this rank's index in its cp
    group): the model computes this rank's head-tail tokens of each row
    (:mod:`oases.parallel.cp_chunks`), while the slot holds the documents of the WHOLE
    rows, (B, T), the same on every cp rank (the loader has the whole row): the ring
    attention reads every rank's document numbers from them, and positions that
    restart at documents are the whole row's. :meth:`local_positions` gives the
    positions of this rank's tokens."""

    def __init__(self) -> None:
        self.current: Optional[Documents] = None
        self.home = 1
        self.pieces: Optional[Callable[[int], tuple[int, int]]] = None
        self.cp = (1, 0)  # (cp degree, rank in the cp group): set by parallelize
        self._views: dict[int, Documents] = {}
        self._local: dict[tuple, torch.Tensor] = {}

    def set(self, docs: Optional[Documents]) -> None:
        self.current = docs
        self._views = {}
        self._local = {}

    def at(self, degree: int) -> Optional[Documents]:
        """The documents of the rows a block of TP degree ``degree`` computes."""
        docs = self.current
        if docs is None or degree == self.home or self.pieces is None:
            return docs
        view = self._views.get(degree)
        if view is None:
            if degree > self.home:
                raise ValueError(f"a block of TP degree {degree} above the stage's home "
                                 f"degree {self.home} computes rows no rank holds documents of")
            piece, k = self.pieces(degree)
            view = self._views[degree] = Documents(docs.doc.chunk(k)[piece], docs.reset_positions)
        return view

    def mask(self, degree: int) -> Optional[torch.Tensor]:
        """(B', 1, T, T) bool of the rows at ``degree``, or None (plain causal)."""
        docs = self.at(degree)
        return None if docs is None else docs.mask()

    def positions(self, degree: int) -> Optional[torch.Tensor]:
        """(B', T) positions of the (whole) rows at ``degree``, or None (0..T-1)."""
        docs = self.at(degree)
        return None if docs is None else docs.positions()

    def local_positions(self, degree: int, tokens: int, device=None) -> Optional[torch.Tensor]:
        """The positions of the ``tokens`` tokens of each row this rank computes: at cp 1
        :meth:`positions` (None: 0..T-1); under cp their positions in the whole row,
        (T/cp,) the same for every row (:func:`~oases.parallel.cp_chunks.global_positions`)
        or, where positions restart at documents, the whole rows' (B', T) positions
        sharded like the tokens, (B', T/cp). Made once per documents (every layer reads
        them)."""
        cp, rank = self.cp
        if cp == 1:
            return self.positions(degree)
        key = (degree, tokens, device)
        pos = self._local.get(key)
        if pos is None:
            whole = self.positions(degree)
            if whole is None:
                pos = global_positions(tokens * cp, cp, rank, device)
            else:
                if whole.shape[1] != tokens * cp:
                    raise ValueError(f"documents of rows of {whole.shape[1]} tokens for a "
                                     f"rank's {tokens} tokens at cp={cp}: the slot holds the "
                                     f"whole rows, {tokens * cp} tokens")
                pos = shard_sequence(whole, cp, rank, dim=1)
            self._local[key] = pos
        return pos

    @contextlib.contextmanager
    def use(self, docs: Optional[Documents]) -> Iterator[None]:
        """``docs`` in the slot for the block; the previous documents back after."""
        before = self.current
        self.set(docs)
        try:
            yield
        finally:
            self.set(before)


def document_mask(ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, T) token ids -> (B, 1, T, T) bool: :meth:`Documents.mask` of the documents
    ``eos_id`` ends."""
    return Documents.from_eos(ids, eos_id).mask()
