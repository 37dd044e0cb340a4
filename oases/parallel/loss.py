"""Cross-entropy over vocabulary-sharded logits, never gathering the full logits.

Each rank holds logits (N, V_pad/tp) for its slice of the vocabulary. Three
small all-reduces over (N,) vectors give the loss:

    m      = max_r max_j z_rj                       (all-reduce MAX)
    s      = sum_r sum_j exp(z_rj - m)              (all-reduce SUM)
    z_t    = logit of the target, from its owner    (all-reduce SUM)
    loss_i = log s - (z_t - m)

Backward is local: softmax_rj - [j == target], times the upstream gradient.
Columns >= ``vocab_size`` (vocabulary padding) are masked to -inf, so padding
never changes the loss or gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from oases.parallel.comm import all_reduce, group_rank, group_size


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, ignore_index):
        z = logits.float()
        n_local = z.shape[-1]
        start = group_rank(group) * n_local
        end = start + n_local
        if end > vocab_size:  # this rank holds padded columns
            z = z.clone()
            z[..., max(vocab_size - start, 0):] = float("-inf")

        m = z.max(dim=-1).values  # (N,)
        if group_size(group) > 1:
            all_reduce(m, group, op=dist.ReduceOp.MAX)
        z = z - m.unsqueeze(-1)

        valid = target != ignore_index
        mine = (target >= start) & (target < end) & valid
        local_t = (target - start).masked_fill(~mine, 0)
        zt = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        e = z.exp()
        s = e.sum(dim=-1)
        if group_size(group) > 1:
            # one message for both sums
            both = torch.stack([zt, s])
            all_reduce(both, group)
            zt, s = both[0], both[1]
        loss = (s.log() - zt).masked_fill(~valid, 0.0)

        ctx.save_for_backward(e, s, local_t, mine, valid)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        e, s, local_t, mine, valid = ctx.saved_tensors
        grad = e / s.unsqueeze(-1)  # softmax of the local columns
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        grad = grad * (g * valid).unsqueeze(-1)
        return grad.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group,
                                 vocab_size: int, ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss (same shape as ``target``) from vocab-sharded ``logits``.

    | tensor | shape on each rank   |
    |--------|----------------------|
    | logits | (..., V_pad/tp)      |
    | target | (...), full vocab ids|
    | result | (...), float32       |
    """
    shape = target.shape
    loss = _VocabParallelCE.apply(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                  group, vocab_size, ignore_index)
    return loss.view(shape)
