"""LLaMA: RMSNorm, rotary embeddings (rotate-half, as HF), SwiGLU, grouped-query
attention; Hugging Face's ``LlamaForCausalLM``. Qwen2 and Mistral (``qwen2.py``,
``mistral.py``) are this with a difference or two, and read and write their
``config.json`` with :func:`llama_fields` and :func:`llama_json`."""

from __future__ import annotations

from oases.config.arch import ArchSpec, HFConfig, HFWeights
from oases.config.hf_json import hf_bool, hf_float, hf_get, hf_int, rope_fields, rope_json
from oases.errors import ConfigError

_BASE = dict(norm_eps=1e-5, bias=False)
_LLAMA3 = dict(_BASE, vocab_size=128256, rope_theta=500000.0, rope_type="llama3",
               rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_len=8192)

SIZES = {
    "llama-tiny": dict(_BASE, n_layer=4, d_model=128, n_head=4, n_kv_heads=2, ffn_hidden=384,
                       vocab_size=256, seq_len=128, rope_theta=10000.0, tie_embeddings=False),
    # Llama-3.2-1B shape, plain RoPE (theta 500000, no Llama 3 scaling; llama3-1b has it)
    "llama-1b": dict(_BASE, n_layer=16, d_model=2048, n_head=32, n_kv_heads=8, ffn_hidden=8192,
                     vocab_size=128256, seq_len=2048, rope_theta=500000.0, tie_embeddings=True),
    # Llama 3.2 1B / 3B and 3.1 8B (their config.json), trained at a shorter seq_len than
    # their 131072 positions; RoPE scaled as published (rope_type llama3)
    "llama3-1b": dict(_LLAMA3, n_layer=16, d_model=2048, n_head=32, n_kv_heads=8,
                      ffn_hidden=8192, tie_embeddings=True, rope_factor=32.0, seq_len=2048),
    "llama3-3b": dict(_LLAMA3, n_layer=28, d_model=3072, n_head=24, n_kv_heads=8,
                      ffn_hidden=8192, tie_embeddings=True, rope_factor=32.0, seq_len=2048),
    "llama3-8b": dict(_LLAMA3, n_layer=32, d_model=4096, n_head=32, n_kv_heads=8,
                      ffn_hidden=14336, tie_embeddings=False, rope_factor=8.0, seq_len=8192),
    # Llama-2-7B shape
    "llama-7b": dict(_BASE, n_layer=32, d_model=4096, n_head=32, n_kv_heads=32, ffn_hidden=11008,
                     vocab_size=32000, seq_len=4096, rope_theta=10000.0, tie_embeddings=False),
}


def llama_fields(cfg: dict, where: str, sliding_window: int = 0) -> dict:
    """The shape fields of a LLaMA-like ``config.json`` (no projection biases)."""
    act = hf_get(cfg, "hidden_act", where, "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act={act!r} is not supported (SwiGLU needs silu)")
    d = hf_int(cfg, "hidden_size", where)
    n_head = hf_int(cfg, "num_attention_heads", where)
    head_dim = hf_int(cfg, "head_dim", where) if cfg.get("head_dim") is not None else None
    if head_dim is not None and n_head and head_dim * n_head != d:
        raise ConfigError(f"{where}: head_dim={head_dim} x num_attention_heads={n_head} != "
                          f"hidden_size={d} is not supported")
    max_pos = hf_int(cfg, "max_position_embeddings", where)
    return dict(n_layer=hf_int(cfg, "num_hidden_layers", where), d_model=d, n_head=n_head,
                n_kv_heads=hf_int(cfg, "num_key_value_heads", where, n_head),
                ffn_hidden=hf_int(cfg, "intermediate_size", where),
                vocab_size=hf_int(cfg, "vocab_size", where), seq_len=max_pos,
                norm_eps=hf_float(cfg, "rms_norm_eps", where, 1e-6),
                **rope_fields(cfg, where, max_pos), sliding_window=sliding_window,
                tie_embeddings=hf_bool(cfg, "tie_word_embeddings", where, False),
                bias=False)


def llama_json(c) -> dict:
    """The ``config.json`` keys every LLaMA-like architecture writes."""
    return {
        "vocab_size": c.vocab_size, "hidden_size": c.d_model,
        "intermediate_size": c.ffn_hidden, "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head, "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.d_model // c.n_head, "hidden_act": "silu",
        # dynamic RoPE rescales past max_position_embeddings: it is the original length
        "max_position_embeddings": (c.rope_original_max_len if c.rope_type == "dynamic"
                                    else c.seq_len),
        "rms_norm_eps": c.norm_eps, **rope_json(c),
        "attention_dropout": c.dropout, "initializer_range": c.init_std,
        "tie_word_embeddings": bool(c.tie_embeddings), "use_cache": True, "dtype": "float32",
    }


def read(cfg: dict, where: str) -> dict:
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ConfigError(f"{where}: {key}=true is not supported (oases LLaMA has no "
                              f"projection biases)")
    if cfg.get("sliding_window"):
        raise ConfigError(f"{where}: sliding_window={cfg['sliding_window']} is not supported "
                          f"for LlamaForCausalLM")
    return llama_fields(cfg, where)


def write(c) -> dict:
    return dict(llama_json(c), attention_bias=bool(c.bias), mlp_bias=bool(c.bias),
                pretraining_tp=1)


# Qwen2's and Mistral's checkpoints use these names too
WEIGHTS = HFWeights(
    prefix="model.", embed="embed_tokens.weight", layer="layers.{i}.",
    attn_norm="input_layernorm", mlp_norm="post_attention_layernorm",
    qkv=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    attn_out="self_attn.o_proj", mlp_in=("mlp.gate_proj", "mlp.up_proj"),
    mlp_out="mlp.down_proj", final_norm="norm")

SPEC = ArchSpec(
    name="llama", module="oases.models.llama:Llama", sizes=SIZES,
    norm="rmsnorm", gated_mlp=True, learned_positions=False, gqa=True,
    hf=HFConfig("LlamaForCausalLM", "llama", read, write), hf_weights=WEIGHTS,
)
