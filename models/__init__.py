"""Model zoo: architectures by name (``model.arch``), sizes in oases.config.sizes."""

from __future__ import annotations

from typing import Optional

import torch

from oases.models.common import CausalLM
from oases.models.gpt import GPT
from oases.models.llama import Llama, Mistral, Qwen2
from oases.config import ModelConfig
from oases.parallel.comm import group_rank, group_size
from oases.parallel.random import TPRNGTracker
from oases.parallel.sharding import init_parameters

ARCHS = {"gpt": GPT, "llama": Llama, "qwen2": Qwen2, "mistral": Mistral}


def build_model(cfg: ModelConfig, padded_vocab: int, tp_group=None,
                tracker: Optional[TPRNGTracker] = None, recompute: str = "none",
                seed: Optional[int] = 0, device: torch.device | str = "cpu",
                degrees: Optional[list[int]] = None, degree_groups=None,
                stage: Optional[tuple[int, int]] = None) -> CausalLM:
    """Build the TP-sharded model for ``cfg`` (already resolved) and initialise it from
    ``seed`` (``None``: leave it uninitialised, e.g. before loading a checkpoint).
    ``degrees``: per-block TP degrees of a plan (``ctx.degree_groups()`` holds the groups).
    ``stage``: the layers [start, stop) of this rank's pipeline stage: only they (and the
    embedding or head where the stage has them) are built and initialised."""
    model = ARCHS[cfg.arch](cfg, padded_vocab, tp_group, tracker, recompute, degrees,
                            degree_groups, stage)
    if seed is not None:
        init_parameters(model, seed, group_rank(tp_group), group_size(tp_group))
    return model.to(device)


def model_stats(cfg: ModelConfig, padded_vocab: int) -> tuple[int, float]:
    """(parameters, training FLOPs per token) of the whole unsharded model, whichever
    part of it this rank holds; built on the meta device, so it costs no memory."""
    with torch.device("meta"):
        model = ARCHS[cfg.arch](cfg, padded_vocab)
    return model.num_params(), model.flops_per_token()


__all__ = ["build_model", "model_stats", "CausalLM", "GPT", "Llama", "Qwen2", "Mistral", "ARCHS"]
