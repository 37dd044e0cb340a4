"""Model zoo: architectures by name (``model.arch``), each declared once by its spec in
oases/config/archs/ (module, sizes, HF mapping); :func:`arch_class` resolves its module."""

from __future__ import annotations

from typing import Optional

import torch

from oases.config import ModelConfig
from oases.models.arch import ArchLM, arch_class
from oases.models.common import CausalLM
from oases.models.gpt import GPT
from oases.models.llama import Llama, Mistral, Qwen2
from oases.models.parallelize import Parallelism, build, parallelize
from oases.parallel.random import TPRNGTracker


def build_model(cfg: ModelConfig, padded_vocab: int, tp_group=None,
                tracker: Optional[TPRNGTracker] = None, recompute: str = "none",
                seed: Optional[int] = 0, device: torch.device | str = "cpu",
                degrees: Optional[list[int]] = None, degree_groups=None,
                stage: Optional[tuple[int, int]] = None, cp_group=None) -> CausalLM:
    """Build the TP-sharded model for ``cfg`` (already resolved) and initialise it from
    ``seed`` (``None``: leave it uninitialised, e.g. before loading a checkpoint).
    ``degrees``: per-block TP degrees of a plan (``ctx.degree_groups()`` holds the groups).
    ``stage``: the layers [start, stop) of this rank's pipeline stage: only they (and the
    embedding or head where the stage has them) are built and initialised. ``cp_group``:
    context parallelism (the model computes each row's head-tail tokens of this rank)."""
    par = Parallelism(tp_group, tracker, recompute,
                      tuple(degrees) if degrees is not None else None, degree_groups, stage,
                      cp_group=cp_group)
    return build(arch_class(cfg.arch), cfg, padded_vocab, par, seed, device)


def model_stats(cfg: ModelConfig, padded_vocab: int) -> tuple[int, float]:
    """(parameters, training FLOPs per token) of the whole unsharded model, whichever
    part of it this rank holds; built on the meta device, so it costs no memory."""
    with torch.device("meta"):
        model = arch_class(cfg.arch)(cfg, padded_vocab)
    return model.num_params(), model.flops_per_token()


__all__ = ["build_model", "model_stats", "Parallelism", "build", "parallelize", "arch_class",
           "ArchLM", "CausalLM", "GPT", "Llama", "Qwen2", "Mistral"]
