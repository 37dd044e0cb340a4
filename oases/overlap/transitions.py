"""Transitions of a sub-batch's activation between TP degrees under the ``oases`` engine
(a plan's per-block degrees, :mod:`oases.parallel.reshard`): a local slice of the batch
rows where the degree drops, an all-gather (a collective like any other, overlapped by
the other sub-batches) where it grows; under sequence parallelism the chunks are
gathered first. :class:`DegreeTransitions` is a part of
:class:`~oases.overlap.engines.OasesEngine`."""

from __future__ import annotations

import torch

from oases.overlap.runner import Program
from oases.overlap.sequence import gather_seq
from oases.parallel.model_view import view_of
from oases.parallel.sequence import seq_split


class DegreeTransitions:
    """The forward transitions and their backward, as programs (``yield from``)."""

    def _to_degree(self, model, x: torch.Tensor, t_from: int, t_to: int) -> Program:
        """Forward transition of an activation between block degrees: a local slice
        when the degree drops, an all-gather (overlapped like any collective) when it
        grows. Returns the new activation (through ``yield from``). Block inputs are
        detached leaves, so the backward of a transition is :meth:`_grad_to_degree`."""
        if t_from == t_to:
            return x
        return (yield from self._on_chunks(model, x, t_from, t_to, self._to_degree_rows))

    def _to_degree_rows(self, model, x: torch.Tensor, t_from: int, t_to: int) -> Program:
        """:meth:`_to_degree` of whole sequences: batch rows move."""
        rs = model.resharder
        group = rs.reshard_group(t_from, t_to)
        if t_to < t_from:
            piece, k = rs.piece(t_from, t_to)
            return x.chunk(k)[piece]
        (gathered,) = yield [("ag", x.detach(), group)]
        return gathered

    def _grad_to_degree(self, model, g: torch.Tensor, t_from: int, t_to: int) -> Program:
        """Backward of the transition t_to -> t_from (gradient of a degree-``t_from``
        block input, wanted at degree ``t_to``): all-gather where the forward sliced,
        slice where it gathered."""
        if t_from == t_to or g is None:
            return g
        return (yield from self._on_chunks(model, g, t_from, t_to, self._grad_to_degree_rows))

    @staticmethod
    def _on_chunks(model, x: torch.Tensor, t_from: int, t_to: int, rows) -> Program:
        """``rows`` (a transition of whole sequences) between degrees; under sequence
        parallelism the chunks are gathered over the ``t_from`` subgroup first and this
        rank's chunk of the ``t_to`` part kept last."""
        if not view_of(model).sequence_parallel:
            return (yield from rows(model, x, t_from, t_to))
        sub = model.resharder.sub
        x = yield from gather_seq(x, sub[t_from])
        return seq_split((yield from rows(model, x, t_from, t_to)), sub[t_to])

    def _grad_to_degree_rows(self, model, g: torch.Tensor, t_from: int, t_to: int) -> Program:
        """:meth:`_grad_to_degree` of whole sequences."""
        rs = model.resharder
        piece, k = rs.piece(t_from, t_to)
        if t_to < t_from:
            return g.chunk(k)[piece]
        (gathered,) = yield [("ag", g.contiguous(), rs.reshard_group(t_from, t_to))]
        return gathered
