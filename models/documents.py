"""Document boundaries in a packed batch: the attention mask that
``data.reset_attention_at_eos`` puts in place of plain causal attention."""

from __future__ import annotations

import torch


def document_mask(ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, T) token ids -> (B, 1, T, T) bool: position i attends to j <= i of its own
    document. An EOS belongs to the document it closes, so the token after it starts
    afresh (as Megatron's ``reset_attention_mask``); the loss is not changed."""
    is_eos = (ids == eos_id).long()
    doc = torch.cumsum(is_eos, dim=1) - is_eos                      # (B, T) document index
    T = ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]  # (B, 1, T, T)
