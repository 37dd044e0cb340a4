"""An architecture's module: its spec (:mod:`oases.config.archs`) names it by a string,
resolved here, and :class:`ArchLM` builds the norm, MLP, positions and q/k/v biases the
spec declares, so each fact is stated once, where the planner and the HF mapping read
it too."""

from __future__ import annotations

import importlib
from typing import Optional

import torch.nn as nn

from oases.config import ModelConfig
from oases.config.archs import get_arch
from oases.models.blocks import GeluMLP, SwiGLUMLP
from oases.models.common import CausalLM
from oases.models.norms import LayerNorm, RMSNorm
from oases.models.rope import Rotary
from oases.parallel.block import TPBlock


def arch_class(name: str) -> type[CausalLM]:
    """The CausalLM subclass of architecture ``name`` (its spec's ``module``)."""
    spec = get_arch(name)
    mod, _, attr = spec.module.partition(":")
    cls = getattr(importlib.import_module(mod), attr, None)
    if not (isinstance(cls, type) and issubclass(cls, CausalLM)):
        raise TypeError(f"arch {name!r}: module={spec.module!r} is not a CausalLM subclass")
    return cls


class ArchLM(CausalLM):
    """A CausalLM whose parts follow the spec of ``cfg.arch``. The hooks read the spec
    from their ``cfg`` argument, not from ``self``, so the planner's profiler can call
    them on a bare instance to build one block."""

    @property
    def learned_positions(self) -> bool:
        return get_arch(self.cfg.arch).learned_positions

    @property
    def qkv_bias(self) -> bool:
        return get_arch(self.cfg.arch).qkv_bias

    def make_norm(self, cfg: ModelConfig) -> nn.Module:
        if get_arch(cfg.arch).norm == "layernorm":
            return LayerNorm(cfg.d_model, cfg.norm_eps, bias=True)
        return RMSNorm(cfg.d_model, cfg.norm_eps)

    def make_mlp(self, cfg: ModelConfig, norm: nn.Module, tp_group) -> TPBlock:
        if get_arch(cfg.arch).gated_mlp:
            return SwiGLUMLP(cfg, norm, tp_group)
        return GeluMLP(cfg, norm, tp_group)

    def make_rotary(self, cfg: ModelConfig) -> Optional[Rotary]:
        return Rotary.from_config(cfg) if get_arch(cfg.arch).rotary else None
