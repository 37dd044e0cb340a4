"""LLaMA-like: RMSNorm, rotary embeddings (rotate-half, as HF), SwiGLU, grouped-query
attention; Qwen2 adds q/k/v biases, Mistral a sliding attention window
(``model.sliding_window``, which the config accepts for arch=mistral only). What each
is, is its spec's (oases/config/archs/llama.py, qwen2.py, mistral.py).

With tensor parallelism the kv heads are split over the ranks while ``parallel.tp``
divides ``model.n_kv_heads``; above that each kv head is replicated on the
``tp / n_kv_heads`` ranks whose query heads use it, and its gradient summed over
them once per step (oases.config.heads, oases.models.attention.ParallelAttention).
"""

from __future__ import annotations

from oases.models.arch import ArchLM


class Llama(ArchLM):
    pass


class Qwen2(Llama):
    pass


class Mistral(Llama):
    pass
