"""The ``model`` section: architecture, shape, RoPE and attention window.

A named size (:mod:`oases.config.sizes`) or a Hugging Face ``config.json``
(``model.init_from=hf:<dir>``, :mod:`oases.config.hf`) fills the fields left unset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from oases.config.archs import arch_names, find_arch, get_arch
from oases.config.hf import apply_init_from
from oases.config.hf_json import ROPE_DEFAULTS, ROPE_TYPES
from oases.config.section import choice, positive, Section
from oases.config.sizes import find_size
from oases.errors import ConfigError

# The model fields that fix the parameters' shapes: a checkpoint or a plan made for one
# model is refused by another that differs in any of them.
SHAPE_KEYS = ("arch", "n_layer", "d_model", "n_head", "n_kv_heads", "ffn_hidden", "vocab_size",
              "seq_len", "tie_embeddings", "bias")

# what a field neither the size nor config.json sets defaults to
_DEFAULTS = dict(ROPE_DEFAULTS, sliding_window=0)


@dataclass
class ModelConfig(Section):
    # A named size from oases.config.sizes; any field left None is taken from it.
    name: str = "gpt-tiny"
    # a registered architecture (oases.config.archs): "gpt" | "llama" | "qwen2" (LLaMA +
    # q/k/v biases) | "mistral" (LLaMA + sliding_window) | one a project registers
    arch: Optional[str] = None
    n_layer: Optional[int] = None
    d_model: Optional[int] = None
    n_head: Optional[int] = None
    n_kv_heads: Optional[int] = None    # < n_head: grouped-query attention
    ffn_hidden: Optional[int] = None
    vocab_size: Optional[int] = None
    seq_len: Optional[int] = None
    norm_eps: Optional[float] = None
    rope_theta: Optional[float] = None
    # RoPE frequency scaling (oases.models.rope), as transformers' rope_type: "default" (none),
    # "linear" (factor), "dynamic" (NTK; factor, original_max_len >= seq_len) or
    # "llama3" (factor, low/high_freq_factor, original_max_len)
    rope_type: Optional[str] = None
    rope_factor: Optional[float] = None
    rope_low_freq_factor: Optional[float] = None
    rope_high_freq_factor: Optional[float] = None
    rope_original_max_len: Optional[int] = None  # default: seq_len
    # arch=mistral: each query attends to its last sliding_window keys (0: all before it)
    sliding_window: Optional[int] = None
    tie_embeddings: Optional[bool] = None
    bias: Optional[bool] = None
    dropout: float = 0.0
    init_std: float = 0.02
    # The embedding/head vocabulary is padded to a multiple of vocab_pad_to * tp;
    # padded logits are masked out of the loss, so padding never changes results.
    vocab_pad_to: int = 64
    # "hf:<dir>": initialise from a local Hugging Face checkpoint directory; the shape
    # fields then come from its config.json
    init_from: str = ""

    def resolve(self) -> None:
        """Fill the None fields from ``init_from=hf:<dir>``'s config.json, then from the
        named size, then the defaults."""
        if self.init_from:
            apply_init_from(self)
        size = find_size(self.name)
        kv_given = self.n_kv_heads is not None
        for k, v in {**_DEFAULTS, **size}.items():
            if getattr(self, k) is None:
                setattr(self, k, v)
        if self.rope_original_max_len is None:
            self.rope_original_max_len = self.seq_len
        spec = find_arch(self.arch)  # None: validate names the unknown arch
        if not kv_given and spec is not None and not spec.gqa:
            self.n_kv_heads = self.n_head  # no GQA (GPT): follow an overridden n_head

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def validate(self) -> None:
        spec = get_arch(self.arch)  # an unknown arch: an error naming the near miss
        for k in ("n_layer", "d_model", "n_head", "n_kv_heads", "ffn_hidden", "vocab_size",
                  "seq_len", "vocab_pad_to"):
            positive(f"model.{k}", getattr(self, k))
        if self.d_model % self.n_head:
            raise ConfigError(f"model.d_model={self.d_model} is not divisible by "
                              f"model.n_head={self.n_head}")
        if self.n_head % self.n_kv_heads:
            raise ConfigError(f"model.n_head={self.n_head} is not divisible by "
                              f"model.n_kv_heads={self.n_kv_heads}")
        if not spec.gqa and self.n_kv_heads != self.n_head:
            raise ConfigError(f"model.n_kv_heads must equal model.n_head for arch={self.arch}")
        if spec.rotary and self.head_dim % 2:
            raise ConfigError(f"rotary embeddings need an even head dim, got {self.head_dim}")
        if spec.bias_refused and self.bias:
            raise ConfigError(f"model.bias=true is not supported for arch={self.arch} "
                              f"({spec.bias_refused})")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")
        positive("model.init_std", self.init_std)
        positive("model.norm_eps", self.norm_eps)
        positive("model.rope_theta", self.rope_theta)
        self._validate_rope_and_window(spec)

    def _validate_rope_and_window(self, spec) -> None:
        choice("model.rope_type", self.rope_type, ROPE_TYPES)
        if spec.learned_positions and self.rope_type != "default":
            raise ConfigError(f"model.rope_type={self.rope_type!r}: arch={self.arch} has "
                              f"learned positions, no RoPE")
        positive("model.rope_factor", self.rope_factor)
        positive("model.rope_original_max_len", self.rope_original_max_len)
        if self.rope_type == "llama3":
            positive("model.rope_low_freq_factor", self.rope_low_freq_factor)
            if not self.rope_high_freq_factor > self.rope_low_freq_factor:
                raise ConfigError(f"model.rope_high_freq_factor={self.rope_high_freq_factor} "
                                  f"must exceed model.rope_low_freq_factor="
                                  f"{self.rope_low_freq_factor}")
        if self.rope_type == "dynamic" and self.seq_len > self.rope_original_max_len:
            raise ConfigError(f"model.seq_len={self.seq_len} exceeds model.rope_original_max_"
                              f"len={self.rope_original_max_len}: rope_type=dynamic would "
                              f"rescale its frequencies by length, which oases does not do")
        positive("model.sliding_window", self.sliding_window, allow_zero=True)
        if self.sliding_window and not spec.sliding_window:
            windowed = [a for a in arch_names() if get_arch(a).sliding_window]
            raise ConfigError(f"model.sliding_window={self.sliding_window} needs arch="
                              f"{' or '.join(windowed)} (arch={self.arch} attends to every "
                              f"earlier token)")
