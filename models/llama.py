"""LLaMA-like: RMSNorm, rotary embeddings (rotate-half, as HF), SwiGLU, grouped-query
attention; Qwen2 adds q/k/v biases, Mistral a sliding attention window
(``model.sliding_window``, which the config accepts for arch=mistral only).

With tensor parallelism the kv heads are split over the ranks while ``parallel.tp``
divides ``model.n_kv_heads``; above that each kv head is replicated on the
``tp / n_kv_heads`` ranks whose query heads use it, and its gradient summed over
them once per step (oases.config.heads, oases.models.attention.ParallelAttention).
"""

from __future__ import annotations

from oases.models.blocks import SwiGLUMLP
from oases.models.common import CausalLM
from oases.models.norms import RMSNorm
from oases.models.rope import Rotary


class Llama(CausalLM):
    learned_positions = False

    def make_norm(self, cfg):
        return RMSNorm(cfg.d_model, cfg.norm_eps)

    def make_mlp(self, cfg, norm, tp_group):
        return SwiGLUMLP(cfg, norm, tp_group)

    def make_rotary(self, cfg):
        return Rotary.from_config(cfg)


class Qwen2(Llama):
    qkv_bias = True


class Mistral(Llama):
    pass
