"""What the ``oases`` engine keeps per sub-batch and per block between its segments
(:mod:`oases.overlap.engines`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from oases.overlap.runner import Stashed


class ReducedAsPartial(torch.autograd.Function):
    """Forward: the all-reduced buffer. Backward: its gradient goes to the partial sum
    unchanged (the all-reduce's backward is the identity). The output shares the
    buffer's memory but is not an autograd view of it, so a ``combine`` may modify it
    in place (autograd forbids that on a custom Function's views); where the buffer
    is also stashed (``fine``) the stash's version check refuses it."""

    @staticmethod
    def forward(ctx, partial, reduced):
        return reduced.detach()

    @staticmethod
    def backward(ctx, g):
        return g, None


@dataclass
class BlockState:
    """One block of one sub-batch. ``out`` set = its autograd graph is live."""
    x_in: Optional[torch.Tensor] = None       # block input (a leaf when the graph is live)
    saved_x: Optional[Stashed] = None         # stashed input for recompute
    saved_r: Optional[Stashed] = None         # stashed all-reduce output (fine)
    rng_partial: Optional[dict] = None
    rng_combine: Optional[dict] = None
    cuts: list = field(default_factory=list)
    later: list = field(default_factory=list)  # deferred backwards (ProgramCut: the ring's)
    out: Optional[torch.Tensor] = None
    # sequence parallelism (oases.overlap.sequence): the graph is live in three pieces
    # prologue x_in -> h, region g -> p, combine (x_in, r) -> out; g and r are leaves
    saved_g: Optional[Stashed] = None         # stashed all-gather output (fine)
    h: Optional[torch.Tensor] = None
    g: Optional[torch.Tensor] = None
    p: Optional[torch.Tensor] = None
    r: Optional[torch.Tensor] = None


@dataclass
class SubBatch:
    name: str
    ids: torch.Tensor                         # token ids, or the stage's input activation
    targets: Optional[torch.Tensor]           # None on a pipeline stage before the last
    share: object                             # of the micro-batch's loss (loss_weights)
    blocks: list = field(default_factory=list)
    head: Optional[tuple] = None
    loss: Optional[torch.Tensor] = None
    out: Optional[torch.Tensor] = None        # output activation (not the last stage)
    grad_out: Optional[torch.Tensor] = None   # its gradient, for the backward
    grad_in: Optional[torch.Tensor] = None    # the input activation's gradient
