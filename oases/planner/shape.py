"""A model's shape as the planner prices it: parameters per block kind and degree (whole
kv heads replicated above ``n_kv_heads`` ranks), the matrices autocast casts, and the
degrees a model's heads and MLP width allow. What differs by architecture (norm, gated
MLP, position table, q/k/v biases) is its spec's (oases.config.archs). Pure Python, no
torch."""

from __future__ import annotations

from dataclasses import dataclass

from oases.config.arch import ArchSpec
from oases.config.archs import get_arch
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

    @property
    def spec(self) -> ArchSpec:
        return get_arch(self.arch)

    def _up(self) -> int:
        """The MLP's input projection width: gate and up of a gated MLP."""
        return (2 if self.spec.gated_mlp else 1) * self.ffn_hidden

    def _qkv_bias(self) -> int:
        return 1 if self.bias or self.spec.qkv_bias else 0

    def block_params(self, kind: str) -> int:
        d, hd = self.d_model, self.d_model // self.n_head
        b = 1 if self.bias else 0
        norm = self.spec.norm_params(d)
        if kind == "attn":
            rows = (self.n_head + 2 * self.n_kv_heads) * hd
            return norm + (d + self._qkv_bias()) * rows + self.n_head * hd * d + b * d
        up = self._up()
        return norm + d * up + b * up + self.ffn_hidden * d + b * d

    def matrix_params(self, kind: str) -> int:
        """A block's weight-matrix parameters: what autocast casts and the matmuls save."""
        d, hd = self.d_model, self.d_model // self.n_head
        if kind == "attn":
            return d * (self.n_head + 2 * self.n_kv_heads) * hd + self.n_head * hd * d
        return d * self._up() + self.ffn_hidden * d

    def norm_params(self, kind: str) -> int:
        """A block's norm parameters (LayerNorm weight and bias, or RMSNorm weight)."""
        return self.spec.norm_params(self.d_model)

    def kv_params(self) -> int:
        """The kv projection's parameters (k and v rows of the fused qkv) of one layer."""
        hd = self.d_model // self.n_head
        return 2 * self.n_kv_heads * hd * (self.d_model + self._qkv_bias())

    def rank_params(self, kind: str, t: int) -> float:
        """Parameters one rank holds of a block at degree t: the block split t ways,
        except that above ``n_kv_heads`` ranks a kv head is replicated, not split
        (oases.config.heads): each rank then holds one kv head, ``kv_params / n_kv_heads``."""
        p = self.block_params(kind) / t
        if kind == "attn" and t > self.n_kv_heads:
            p += self.kv_params() / self.n_kv_heads - self.kv_params() / t
        return p

    def embed_params(self) -> int:
        """The token embedding and, with learned positions, the position table."""
        d = self.d_model
        return self.vocab_size * d + (self.seq_len * d if self.spec.learned_positions else 0)

    def final_norm_params(self) -> int:
        return self.spec.norm_params(self.d_model)

    def other_params(self) -> int:
        """Embedding (+ positions), final norm, untied head."""
        n = self.embed_params() + self.final_norm_params()
        if not self.tie_embeddings:
            n += self.vocab_size * self.d_model
        return n

    def kinds(self) -> list[str]:
        return [k for _ in range(self.n_layer) for k in ("attn", "mlp")]

    def valid_degrees(self, tp: int) -> list[int]:
        out = []
        t = 1
        while t <= tp:
            if tp % t == 0 and heads_problem(self.n_head, self.n_kv_heads, t) is None \
                    and self.ffn_hidden % t == 0:
                out.append(t)
            t *= 2
        return out
