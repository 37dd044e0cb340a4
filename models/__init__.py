"""Model zoo: architectures by name (``model.arch``), sizes in oases.model_sizes."""

from __future__ import annotations

from typing import Optional

import torch

from models.common import CausalLM
from models.gpt import GPT
from models.llama import Llama
from oases.config import ModelConfig
from oases.parallel.comm import group_rank, group_size
from oases.parallel.random import TPRNGTracker
from oases.parallel.sharding import init_parameters

ARCHS = {"gpt": GPT, "llama": Llama}


def build_model(cfg: ModelConfig, padded_vocab: int, tp_group=None,
                tracker: Optional[TPRNGTracker] = None, recompute: str = "none",
                seed: Optional[int] = 0, device: torch.device | str = "cpu",
                degrees: Optional[list[int]] = None, degree_groups=None) -> CausalLM:
    """Build the TP-sharded model for ``cfg`` (already resolved) and initialise it from
    ``seed`` (``None``: leave it uninitialised, e.g. before loading a checkpoint).
    ``degrees``: per-block TP degrees of a plan (``ctx.degree_groups()`` holds the groups)."""
    model = ARCHS[cfg.arch](cfg, padded_vocab, tp_group, tracker, recompute, degrees,
                            degree_groups)
    if seed is not None:
        init_parameters(model, seed, group_rank(tp_group), group_size(tp_group))
    return model.to(device)


__all__ = ["build_model", "CausalLM", "GPT", "Llama", "ARCHS"]
