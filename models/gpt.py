"""GPT-2 style: learned positions, LayerNorm, GELU (tanh), optional tied embeddings, as
its spec says (oases/config/archs/gpt.py)."""

from __future__ import annotations

from oases.models.arch import ArchLM


class GPT(ArchLM):
    pass
