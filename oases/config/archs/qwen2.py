"""Qwen2: LLaMA with q/k/v biases (always, and no other projection bias); Hugging Face's
``Qwen2ForCausalLM`` (its windowed layers are refused)."""

from __future__ import annotations

import dataclasses

from oases.config.arch import HFConfig
from oases.config.archs import llama
from oases.config.hf_json import hf_int
from oases.errors import ConfigError

SIZES = {
    # Qwen2-0.5B: tied, 14 heads over 2 kv heads
    "qwen2-0.5b": dict(norm_eps=1e-6, bias=False, n_layer=24, d_model=896, n_head=14,
                       n_kv_heads=2, ffn_hidden=4864, vocab_size=151936, seq_len=2048,
                       rope_theta=1000000.0, tie_embeddings=True),
}


def read(cfg: dict, where: str) -> dict:
    n_layer = hf_int(cfg, "num_hidden_layers", where)
    sliding = [t for t in cfg.get("layer_types") or () if t != "full_attention"]
    if cfg.get("use_sliding_window") and hf_int(cfg, "max_window_layers", where, 0) < n_layer:
        raise ConfigError(f"{where}: use_sliding_window=true is not supported (Qwen2's "
                          f"windowed layers from max_window_layers on)")
    if sliding:
        raise ConfigError(f"{where}: layer_types={sliding[0]!r} is not supported "
                          f"(every layer attends fully)")
    return llama.llama_fields(cfg, where)


def write(c) -> dict:
    return dict(llama.llama_json(c), use_sliding_window=False, sliding_window=None,
                max_window_layers=c.n_layer)


SPEC = dataclasses.replace(
    llama.SPEC, name="qwen2", module="oases.models.llama:Qwen2", sizes=SIZES, qkv_bias=True,
    bias_refused="Qwen2 has q/k/v biases only, and always",
    hf=HFConfig("Qwen2ForCausalLM", "qwen2", read, write),
)
