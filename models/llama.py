"""LLaMA-like: RMSNorm, rotary embeddings (rotate-half, as HF), SwiGLU, grouped-query attention.

With tensor parallelism the kv heads are split over the ranks while ``parallel.tp``
divides ``model.n_kv_heads``; above that each kv head is replicated on the
``tp / n_kv_heads`` ranks whose query heads use it, and its gradient summed over
them once per step (oases.config.heads, models.common.ParallelAttention).
"""

from __future__ import annotations

from models.common import CausalLM, RMSNorm, Rotary, SwiGLUMLP


class Llama(CausalLM):
    learned_positions = False

    def make_norm(self, cfg):
        return RMSNorm(cfg.d_model, cfg.norm_eps)

    def make_mlp(self, cfg, norm, tp_group):
        return SwiGLUMLP(cfg, norm, tp_group)

    def make_rotary(self, cfg):
        return Rotary(cfg.head_dim, cfg.seq_len, cfg.rope_theta)
