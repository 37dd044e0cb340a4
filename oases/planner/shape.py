"""A model's shape as the planner prices it: parameters per block kind and degree (whole
kv heads replicated above ``n_kv_heads`` ranks), the matrices autocast casts, and the
degrees a model's heads and MLP width allow. Pure Python, no torch."""

from __future__ import annotations

from dataclasses import dataclass

from oases.config.heads import heads_problem


@dataclass
class ModelShape:
    arch: str
    n_layer: int
    d_model: int
    n_head: int
    n_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    seq_len: int
    tie_embeddings: bool = True
    bias: bool = True

    @classmethod
    def from_config(cls, m) -> "ModelShape":
        return cls(m.arch, m.n_layer, m.d_model, m.n_head, m.n_kv_heads, m.ffn_hidden,
                   m.vocab_size, m.seq_len, bool(m.tie_embeddings), bool(m.bias))

    def block_params(self, kind: str) -> int:
        d, hd = self.d_model, self.d_model // self.n_head
        b = 1 if self.bias else 0
        norm = d * (2 if self.arch == "gpt" else 1)
        if kind == "attn":
            qkv = d * (self.n_head + 2 * self.n_kv_heads) * hd + b * (self.n_head + 2 * self.n_kv_heads) * hd
            return norm + qkv + self.n_head * hd * d + b * d
        up = (2 if self.arch == "llama" else 1) * self.ffn_hidden
        return norm + d * up + b * up + self.ffn_hidden * d + b * d

    def matrix_params(self, kind: str) -> int:
        """A block's weight-matrix parameters: what autocast casts and the matmuls save."""
        d, hd = self.d_model, self.d_model // self.n_head
        if kind == "attn":
            return d * (self.n_head + 2 * self.n_kv_heads) * hd + self.n_head * hd * d
        return d * (2 if self.arch == "llama" else 1) * self.ffn_hidden + self.ffn_hidden * d

    def norm_params(self, kind: str) -> int:
        """A block's norm parameters (LayerNorm weight and bias, or RMSNorm weight)."""
        return self.d_model * (2 if self.arch == "gpt" else 1)

    def kv_params(self) -> int:
        """The kv projection's parameters (k and v rows of the fused qkv) of one layer."""
        hd, b = self.d_model // self.n_head, 1 if self.bias else 0
        return 2 * self.n_kv_heads * hd * (self.d_model + b)

    def rank_params(self, kind: str, t: int) -> float:
        """Parameters one rank holds of a block at degree t: the block split t ways,
        except that above ``n_kv_heads`` ranks a kv head is replicated, not split
        (oases.config.heads): each rank then holds one kv head, ``kv_params / n_kv_heads``."""
        p = self.block_params(kind) / t
        if kind == "attn" and t > self.n_kv_heads:
            p += self.kv_params() / self.n_kv_heads - self.kv_params() / t
        return p

    def other_params(self) -> int:
        """Embedding (+ positions), final norm, untied head."""
        d = self.d_model
        n = self.vocab_size * d + (self.seq_len * d if self.arch == "gpt" else 0)
        n += d * (2 if self.arch == "gpt" else 1)
        if not self.tie_embeddings:
            n += self.vocab_size * d
        return n

    def kinds(self) -> list[str]:
        return [k for _ in range(self.n_layer) for k in ("attn", "mlp")]

    def valid_degrees(self, T: int) -> list[int]:
        out = []
        t = 1
        while t <= T:
            if T % t == 0 and heads_problem(self.n_head, self.n_kv_heads, t) is None \
                    and self.ffn_hidden % t == 0:
                out.append(t)
            t *= 2
        return out
