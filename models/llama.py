"""LLaMA-like: RMSNorm, rotary embeddings (rotate-half, as HF), SwiGLU, grouped-query attention.

With tensor parallelism every rank owns whole kv heads: ``parallel.tp`` must
divide ``model.n_kv_heads`` (config validation refuses otherwise). Replicating
kv heads across ranks would need an extra gradient reduction of the kv weights
over the replicas; oases refuses instead of silently paying for it.
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
