"""GPT-2 style: learned positions, LayerNorm, GELU (tanh), optional tied embeddings."""

from __future__ import annotations

from oases.models.blocks import GeluMLP
from oases.models.common import CausalLM
from oases.models.norms import LayerNorm


class GPT(CausalLM):
    learned_positions = True

    def make_norm(self, cfg):
        return LayerNorm(cfg.d_model, cfg.norm_eps, bias=True)

    def make_mlp(self, cfg, norm, tp_group):
        return GeluMLP(cfg, norm, tp_group)
