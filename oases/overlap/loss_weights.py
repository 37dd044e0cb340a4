"""How the pieces of a batch weigh in its mean loss.

A language model's loss is a mean over the targets that count: a target equal to
``IGNORE_INDEX`` (padding, a masked prompt) adds nothing to the sum and nothing to
the count. Cut the batch into pieces -- the ``oases`` engine's sub-batches, a step's
micro-batches, the DP ranks, the rows of a partial validation batch -- and the
mean of the pieces' means is the batch's mean only while every piece counts as
many targets. In general, with ``n_k`` the targets that count in piece ``k``,

    mean = sum_k n_k mean_k / N,      N = sum_k n_k

so piece ``k``'s loss, and its gradient, enter with the weight ``n_k / N``: its
share of the batch. The weights are known before any forward (they depend on the
targets only), so every piece's backward is seeded with its share and the
gradients simply add up; nothing is reweighted afterwards. A piece that counts
nothing has share 0 (its mean is 0 and its gradient too); a batch that counts
nothing has the mean 0, as the model's own loss over such a batch.

A model says how many terms its mean over ``targets`` has through
``loss_tokens(targets)`` (:class:`oases.models.common.CausalLM` counts the targets that
are not ``IGNORE_INDEX``). A model without it (a per-element mean such as MSE over
pieces of equal size) has its pieces weigh alike: each counts 1.
"""

from __future__ import annotations

from typing import Optional

import torch

from oases.parallel.model_view import Count, view_of


def loss_tokens(model, targets: torch.Tensor) -> Count:
    """How many terms ``model``'s mean loss over ``targets`` averages (1 if the model
    does not say): an int tensor on the targets' device, or an int."""
    return view_of(model).count(targets)


def shares(counts: list[Count]) -> list:
    """Each piece's share ``n_k / N`` of the batch's mean (all 0 when ``N`` is 0).
    Tensor counts give 0-d float tensors (no host synchronisation), ints give floats."""
    if counts and isinstance(counts[0], torch.Tensor):
        total = torch.stack(counts).sum().clamp(min=1)
        return [c / total for c in counts]
    total = max(sum(counts), 1)
    return [c / total for c in counts]


def piece_shares(model, targets: list[Optional[torch.Tensor]]) -> list:
    """The shares of a batch cut into pieces of ``targets``; equal shares where there
    are no targets (a pipeline stage before the loss's: its share is never used)."""
    if any(t is None for t in targets):
        return [1.0 / len(targets)] * len(targets)
    return shares([loss_tokens(model, t) for t in targets])
