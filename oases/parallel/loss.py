"""Cross-entropy over vocabulary-sharded logits, never gathering the full logits.

Each rank holds logits (N, V_pad/tp) for its slice of the vocabulary. It computes
three statistics per token over its own columns,

    m_r  = max_j z_rj            s_r = sum_j exp(z_rj - m_r)
    t_r  = z_target if rank r owns the target's column, else 0

and writes them into its slot of a (tp, 3, N) buffer that is zero elsewhere. One
all-reduce (sum) of that buffer gives every rank all the slots, and the loss is
local from there:

    M = max_r m_r,   lse = M + log sum_r s_r exp(m_r - M),   loss = lse - sum_r t_r

One small collective instead of the usual three (max, sum, target logit), and
the loss splits into a local half (:func:`ce_partial`) and a finishing half
(:func:`ce_combine`) around it, so a schedule can overlap that collective like
any other (the ``oases`` engine does). Backward is local:
softmax_rj - [j == target], times the upstream gradient. Columns >= ``vocab_size``
(vocabulary padding) are masked to -inf, so padding never changes the loss or
gradients, even on a rank whose slice is all padding. A target equal to
``IGNORE_INDEX`` (padding, a masked prompt) gets loss 0 and no gradient: it does not
count, and a mean over a batch is over the targets that do (see
:mod:`oases.overlap.loss_weights` for batches cut into pieces).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oases.parallel.comm import all_reduce, group_rank, group_size

IGNORE_INDEX = -100  # a target that does not count (as torch's cross_entropy)


@dataclass
class CEState:
    """What :func:`ce_combine` needs from :func:`ce_partial` (one rank's half)."""
    logits: torch.Tensor       # (N, V_pad/tp), the autograd input
    e: torch.Tensor            # exp(z - m_local), fp32, no grad
    m_local: torch.Tensor      # (N,) the finite shift used for e
    local_t: torch.Tensor      # (N,) target column in this slice (0 where not mine)
    mine: torch.Tensor         # (N,) bool: this rank owns the target's column
    valid: torch.Tensor        # (N,) bool: target != ignore_index
    rank: int


@torch.no_grad()
def ce_partial(logits: torch.Tensor, target: torch.Tensor, group, vocab_size: int,
               ignore_index: int = IGNORE_INDEX) -> tuple[CEState, torch.Tensor]:
    """The local half: (state, stats buffer to sum over ``group``). 2-D ``logits``."""
    z = logits.detach().float()
    tp, rank = group_size(group), group_rank(group)
    n_local = z.shape[-1]
    start = rank * n_local
    end = start + n_local
    if end > vocab_size:  # this rank holds padded columns
        z = z.clone()
        z[..., max(vocab_size - start, 0):] = float("-inf")
    m = z.max(dim=-1).values                      # -inf on a slice that is all padding
    m_local = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = (z - m_local.unsqueeze(-1)).exp()
    valid = target != ignore_index
    mine = (target >= start) & (target < end) & valid
    local_t = (target - start).masked_fill(~mine, 0)
    zt = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
    stats = torch.zeros(tp, 3, z.shape[0], dtype=torch.float32, device=z.device)
    stats[rank, 0] = m
    stats[rank, 1] = e.sum(dim=-1)
    stats[rank, 2] = zt
    return CEState(logits, e, m_local, local_t, mine, valid, rank), stats


class _CEFinish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, st: CEState, stats):
        m_all, s_all, t_all = stats[:, 0], stats[:, 1], stats[:, 2]
        top = m_all.max(dim=0).values                           # finite: some rank has columns
        log_s = (s_all * (m_all - top).exp()).sum(dim=0).log()
        lse = top + log_s
        # (top - z_t) first: two close numbers, so no rounding at the logits' magnitude
        loss = ((top - t_all.sum(dim=0)) + log_s).masked_fill(~st.valid, 0.0)
        ctx.st, ctx.lse, ctx.dtype = st, lse, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        st = ctx.st
        grad = st.e * (st.m_local - ctx.lse).exp().unsqueeze(-1)  # softmax of local columns
        grad.scatter_add_(-1, st.local_t.unsqueeze(-1), -st.mine.to(grad.dtype).unsqueeze(-1))
        grad = grad * (g * st.valid).unsqueeze(-1)
        ctx.st = None
        return grad.to(ctx.dtype), None, None


def ce_combine(st: CEState, stats: torch.Tensor) -> torch.Tensor:
    """The finishing half: per-token loss (N,) from the summed ``stats``."""
    return _CEFinish.apply(st.logits, st, stats)


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group,
                                 vocab_size: int, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-token loss (same shape as ``target``) from vocab-sharded ``logits``, with a
    blocking all-reduce between the two halves.

    | tensor | shape on each rank   |
    |--------|----------------------|
    | logits | (..., V_pad/tp)      |
    | target | (...), full vocab ids|
    | result | (...), float32       |
    """
    shape = target.shape
    st, stats = ce_partial(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), group,
                           vocab_size, ignore_index)
    if group_size(group) > 1:
        all_reduce(stats, group)
    return ce_combine(st, stats).view(shape)
