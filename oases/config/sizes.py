"""Named model sizes: data, not code branches.

Each entry gives every shape field of :class:`oases.config.ModelConfig`; a YAML
file or override may still change any single field (``model.n_layer=2``).
``ffn_hidden`` is the width of the MLP's hidden layer (for SwiGLU, of each of the
gate and up projections). Fields a size leaves out take ModelConfig's defaults
(plain RoPE, no sliding window).
"""

from __future__ import annotations

_GPT = dict(arch="gpt", norm_eps=1e-5, rope_theta=10000.0, tie_embeddings=True, bias=True)
_LLAMA = dict(arch="llama", norm_eps=1e-5, bias=False)
_LLAMA3 = dict(_LLAMA, vocab_size=128256, rope_theta=500000.0, rope_type="llama3",
               rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_len=8192)

MODEL_SIZES: dict[str, dict] = {
    # byte-level vocabulary: trains on the shipped demo corpus with no tokenizer
    "gpt-tiny": dict(_GPT, n_layer=4, d_model=128, n_head=4, n_kv_heads=4, ffn_hidden=512,
                     vocab_size=256, seq_len=128),
    "gpt-125m": dict(_GPT, n_layer=12, d_model=768, n_head=12, n_kv_heads=12, ffn_hidden=3072,
                     vocab_size=50257, seq_len=1024),
    "gpt-350m": dict(_GPT, n_layer=24, d_model=1024, n_head=16, n_kv_heads=16, ffn_hidden=4096,
                     vocab_size=50257, seq_len=1024),
    "gpt-1.3b": dict(_GPT, n_layer=24, d_model=2048, n_head=16, n_kv_heads=16, ffn_hidden=8192,
                     vocab_size=50257, seq_len=2048),
    "llama-tiny": dict(_LLAMA, n_layer=4, d_model=128, n_head=4, n_kv_heads=2, ffn_hidden=384,
                       vocab_size=256, seq_len=128, rope_theta=10000.0, tie_embeddings=False),
    # Llama-3.2-1B shape, plain RoPE (theta 500000, no Llama 3 scaling; llama3-1b has it)
    "llama-1b": dict(_LLAMA, n_layer=16, d_model=2048, n_head=32, n_kv_heads=8, ffn_hidden=8192,
                     vocab_size=128256, seq_len=2048, rope_theta=500000.0, tie_embeddings=True),
    # Llama 3.2 1B / 3B and 3.1 8B (their config.json), trained at a shorter seq_len than
    # their 131072 positions; RoPE scaled as published (rope_type llama3)
    "llama3-1b": dict(_LLAMA3, n_layer=16, d_model=2048, n_head=32, n_kv_heads=8,
                      ffn_hidden=8192, tie_embeddings=True, rope_factor=32.0, seq_len=2048),
    "llama3-3b": dict(_LLAMA3, n_layer=28, d_model=3072, n_head=24, n_kv_heads=8,
                      ffn_hidden=8192, tie_embeddings=True, rope_factor=32.0, seq_len=2048),
    "llama3-8b": dict(_LLAMA3, n_layer=32, d_model=4096, n_head=32, n_kv_heads=8,
                      ffn_hidden=14336, tie_embeddings=False, rope_factor=8.0, seq_len=8192),
    # Qwen2-0.5B: q/k/v biases (arch qwen2), tied, 14 heads over 2 kv heads
    "qwen2-0.5b": dict(arch="qwen2", norm_eps=1e-6, bias=False, n_layer=24, d_model=896,
                       n_head=14, n_kv_heads=2, ffn_hidden=4864, vocab_size=151936,
                       seq_len=2048, rope_theta=1000000.0, tie_embeddings=True),
    # Llama-2-7B shape
    "llama-7b": dict(_LLAMA, n_layer=32, d_model=4096, n_head=32, n_kv_heads=32, ffn_hidden=11008,
                     vocab_size=32000, seq_len=4096, rope_theta=10000.0, tie_embeddings=False),
}
