"""Mistral: LLaMA with a sliding attention window (``model.sliding_window``) and no
projection biases; Hugging Face's ``MistralForCausalLM``."""

from __future__ import annotations

import dataclasses

from oases.config.arch import HFConfig
from oases.config.archs import llama
from oases.config.hf_json import hf_int


def read(cfg: dict, where: str) -> dict:
    return llama.llama_fields(cfg, where, hf_int(cfg, "sliding_window", where, 0))


def write(c) -> dict:
    return dict(llama.llama_json(c), sliding_window=c.sliding_window or None)


SPEC = dataclasses.replace(
    llama.SPEC, name="mistral", module="oases.models.llama:Mistral", sizes={},
    sliding_window=True, bias_refused="Mistral has no projection biases",
    hf=HFConfig("MistralForCausalLM", "mistral", read, write),
)
