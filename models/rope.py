"""Rotary position embeddings (rotate-half, as HF LLaMA) and their frequency scalings.

``rope_inv_freq`` reproduces transformers' ``modeling_rope_utils`` for the types
oases supports (``model.rope_type``):

    default   inv_freq_i = theta^(-2i/hd)
    linear    inv_freq / factor                      (positions stretched by ``factor``)
    dynamic   NTK-aware: theta grows once a sequence exceeds ``original_max_len``
              positions; oases trains and decodes within them (the config refuses a
              longer ``seq_len``), where it equals ``default``
    llama3    Llama 3.1: wavelengths above original_max_len / low_freq_factor are
              divided by ``factor``, those below original_max_len / high_freq_factor
              kept, and the band between interpolated smoothly

None of these scales the attention (transformers' ``attention_factor`` is 1 for them).
Everything is float32 and computed as transformers computes it (``modeling_rope_utils``,
``LlamaRotaryEmbedding``): the exponents ``arange(0, hd, 2)`` as int64 then float32, the
scaling in float32, the angles ``position * inv_freq`` as float32 products, cos and sin
of them; so the tables are transformers' at every position (float64 angles would
differ from them more and more with the position: 1e-2 in cos near position 131072).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

from oases.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """(hd/2,) float32 inverse frequencies of ``cfg``'s RoPE (see the module doc)."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    kind = cfg.rope_type
    if kind in ("default", "dynamic"):
        return inv
    if kind == "linear":
        return inv / cfg.rope_factor
    if kind == "llama3":
        factor, lo, hi = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        old = cfg.rope_original_max_len
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"model.rope_type={kind!r} has no frequencies")  # validated before


class Rotary(nn.Module):
    """Rotary embeddings, rotate-half convention (as HF LLaMA): no weight permutation.
    Tables for positions 0 .. max_len-1; a forward rotates positions 0..T-1, or the
    (B, T) ``positions`` it is given (decoding with a cache, left padding; documents),
    or (T,) ones shared by every row (context parallelism's global positions)."""

    def __init__(self, inv_freq: torch.Tensor, max_len: int) -> None:
        super().__init__()
        positions = torch.arange(max_len, device=inv_freq.device).float()
        freqs = positions[:, None] * inv_freq.float()[None, :]      # (T, hd/2), as HF's
        emb = torch.cat([freqs, freqs], dim=-1)                     # (T, hd)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "Rotary":
        return cls(rope_inv_freq(cfg), cfg.seq_len)

    @staticmethod
    def _rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    def tables(self, T: int, positions: Optional[torch.Tensor], dtype) -> tuple:
        """(cos, sin) of positions 0..T-1, (T, hd), of (T,) ``positions`` shared by every
        row (a context-parallel rank's global ones), (T, hd), or of the (B, T)
        ``positions``, (B, 1, T, hd): what every layer of one forward uses."""
        if positions is None:
            return self.cos[:T].to(dtype), self.sin[:T].to(dtype)
        if positions.dim() == 1:
            return self.cos[positions].to(dtype), self.sin[positions].to(dtype)
        return (self.cos[positions].to(dtype).unsqueeze(1),
                self.sin[positions].to(dtype).unsqueeze(1))

    def forward(self, q, k, positions: Optional[torch.Tensor] = None,
                tables: Optional[tuple] = None):
        """q (B, nh, T, hd), k (B, nkv, T, hd); ``positions`` (B, T) or (T,) long, or None;
        ``tables``: :meth:`tables` made once for all layers (decoding)."""
        cos, sin = tables if tables is not None else self.tables(q.shape[-2], positions,
                                                                 q.dtype)
        return (q * cos + self._rotate_half(q) * sin,
                k * cos + self._rotate_half(k) * sin)
