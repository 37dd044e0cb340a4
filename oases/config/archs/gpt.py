"""GPT-2: learned positions, LayerNorm, tanh-GELU, no grouped-query attention; Hugging
Face's ``GPT2LMHeadModel``."""

from __future__ import annotations

from oases.config.arch import ArchSpec, HFConfig, HFWeights
from oases.config.hf_json import ROPE_DEFAULTS, hf_bool, hf_float, hf_get, hf_int
from oases.errors import ConfigError

_BASE = dict(norm_eps=1e-5, rope_theta=10000.0, tie_embeddings=True, bias=True)

SIZES = {
    # byte-level vocabulary: trains on the shipped demo corpus with no tokenizer
    "gpt-tiny": dict(_BASE, n_layer=4, d_model=128, n_head=4, n_kv_heads=4, ffn_hidden=512,
                     vocab_size=256, seq_len=128),
    "gpt-125m": dict(_BASE, n_layer=12, d_model=768, n_head=12, n_kv_heads=12, ffn_hidden=3072,
                     vocab_size=50257, seq_len=1024),
    "gpt-350m": dict(_BASE, n_layer=24, d_model=1024, n_head=16, n_kv_heads=16, ffn_hidden=4096,
                     vocab_size=50257, seq_len=1024),
    "gpt-1.3b": dict(_BASE, n_layer=24, d_model=2048, n_head=16, n_kv_heads=16, ffn_hidden=8192,
                     vocab_size=50257, seq_len=2048),
}


def read(cfg: dict, where: str) -> dict:
    act = hf_get(cfg, "activation_function", where, "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(f"{where}: activation_function={act!r} is not supported "
                          f"(oases GPT uses tanh GELU: gelu_new or gelu_pytorch_tanh)")
    if cfg.get("scale_attn_by_inverse_layer_idx"):
        raise ConfigError(f"{where}: scale_attn_by_inverse_layer_idx=true is not supported")
    if cfg.get("scale_attn_weights") is False:
        raise ConfigError(f"{where}: scale_attn_weights=false is not supported")
    if cfg.get("add_cross_attention"):
        raise ConfigError(f"{where}: add_cross_attention=true is not supported")
    d = hf_int(cfg, "n_embd", where)
    n_pos = hf_int(cfg, "n_positions", where)
    return dict(n_layer=hf_int(cfg, "n_layer", where), d_model=d,
                n_head=hf_int(cfg, "n_head", where), n_kv_heads=hf_int(cfg, "n_head", where),
                ffn_hidden=hf_int(cfg, "n_inner", where, 4 * d),
                vocab_size=hf_int(cfg, "vocab_size", where), seq_len=n_pos,
                norm_eps=hf_float(cfg, "layer_norm_epsilon", where, 1e-5),
                # unused by GPT (learned positions), filled so every field has a value
                **ROPE_DEFAULTS, rope_theta=10000.0, rope_original_max_len=n_pos,
                sliding_window=0,
                tie_embeddings=hf_bool(cfg, "tie_word_embeddings", where, True), bias=True)


def write(c) -> dict:
    special = 50256 if c.vocab_size > 50256 else None  # GPT-2's <|endoftext|>, if present
    return {
        "vocab_size": c.vocab_size, "n_positions": c.seq_len, "n_embd": c.d_model,
        "n_layer": c.n_layer, "n_head": c.n_head, "n_inner": c.ffn_hidden,
        "activation_function": "gelu_new", "layer_norm_epsilon": c.norm_eps,
        "resid_pdrop": c.dropout, "embd_pdrop": c.dropout, "attn_pdrop": c.dropout,
        "initializer_range": c.init_std, "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": bool(c.tie_embeddings), "use_cache": True,
        "bos_token_id": special, "eos_token_id": special, "dtype": "float32",
    }


SPEC = ArchSpec(
    name="gpt", module="oases.models.gpt:GPT", sizes=SIZES,
    norm="layernorm", gated_mlp=False, learned_positions=True, gqa=False,
    hf=HFConfig("GPT2LMHeadModel", "gpt2", read, write),
    hf_weights=HFWeights(
        prefix="transformer.", embed="wte.weight", positions="wpe.weight", layer="h.{i}.",
        attn_norm="ln_1", mlp_norm="ln_2", qkv=("attn.c_attn",), attn_out="attn.c_proj",
        mlp_in=("mlp.c_fc",), mlp_out="mlp.c_proj", final_norm="ln_f",
        conv1d=True, always_bias=True),
)
