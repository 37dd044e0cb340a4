"""What an architecture declares, once: its facts, its named sizes, its Hugging Face
``config.json`` mapping and weight layout (the registry: :mod:`oases.config.archs`).

In the spirit of torchtitan's ``TrainSpec``, with one difference the floors impose:
``oases.config`` stands below ``oases.models`` and must validate a config without it, so
a spec is data. Its module is a string (``"oases.models.llama:Llama"``) that
:func:`oases.models.arch_class` resolves, and its weight layout is a table that
:mod:`oases.models.hf` interprets. Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

# the norms a spec may name: (oases.models.norms class, parameters per model dim)
NORMS = {"layernorm": 2, "rmsnorm": 1}  # LayerNorm has a weight and a bias, RMSNorm a weight
# the RoPE fields, of no use to an architecture with learned positions
ROPE_FIELDS = ("rope_theta", "rope_type", "rope_factor", "rope_low_freq_factor",
               "rope_high_freq_factor", "rope_original_max_len")


@dataclass(frozen=True)
class HFConfig:
    """An architecture's ``config.json``, both ways.

    ``read(cfg, where)``: the parsed config.json -> ModelConfig shape fields (all of
    ``oases.config.hf.HF_FIELDS`` but ``arch``); anything oases cannot reproduce exactly
    is a ConfigError naming the field (``where`` prefixes the message).
    ``write(model_cfg)``: a resolved ModelConfig -> config.json keys, less
    ``architectures`` and ``model_type``, which come from this spec."""

    architecture: str                       # "LlamaForCausalLM"
    model_type: str                         # "llama"
    read: Callable[[dict, str], dict]
    write: Callable[[Any], dict]


@dataclass(frozen=True)
class HFWeights:
    """Where the parameters live in a Hugging Face checkpoint. Names are relative to
    ``prefix``, ``{i}`` stands for the layer, a projection's name takes ``.weight`` and
    ``.bias``; the norms' parameters follow the spec's ``norm``."""

    prefix: str                  # "model."
    embed: str                   # token embedding: "embed_tokens.weight"
    layer: str                   # a layer's names start with it: "layers.{i}."
    attn_norm: str               # "input_layernorm"
    mlp_norm: str                # "post_attention_layernorm"
    qkv: tuple[str, ...]         # fused (one name: [q | k | v] on the output axis) or q, k, v
    attn_out: str                # "self_attn.o_proj"
    mlp_in: tuple[str, ...]      # one, or gate and up of a gated MLP (oases fuses them)
    mlp_out: str                 # "mlp.down_proj"
    final_norm: str              # "norm"
    positions: str = ""          # learned position table ("wpe.weight"); "" for none
    head: str = "lm_head.weight"  # an untied head's name, outside the prefix
    conv1d: bool = False         # matrices stored [in, out] (GPT-2's Conv1D)
    always_bias: bool = False    # the checkpoint has every projection bias, even at bias=false

    def __post_init__(self) -> None:
        if len(self.qkv) not in (1, 3):
            raise ValueError(f"HFWeights.qkv={self.qkv}: one fused name or three (q, k, v)")
        if not self.mlp_in or len(self.mlp_in) > 2:
            raise ValueError(f"HFWeights.mlp_in={self.mlp_in}: one name, or gate and up")


@dataclass(frozen=True)
class ArchSpec:
    """One architecture (``model.arch``): everything oases knows about it."""

    name: str                          # model.arch
    module: str                        # "package.module:Class", a CausalLM subclass
    # named sizes: name -> every shape field but ``arch`` (oases.config.sizes)
    sizes: Mapping[str, dict] = field(default_factory=dict)
    norm: str = "rmsnorm"              # a key of NORMS
    gated_mlp: bool = True             # SwiGLU (gate and up, ffn_hidden each); else tanh-GELU
    learned_positions: bool = False    # a position table; else rotary embeddings
    gqa: bool = True                   # n_kv_heads may be below n_head
    qkv_bias: bool = False             # q/k/v biases whatever model.bias says (Qwen2)
    sliding_window: bool = False       # accepts model.sliding_window
    bias_refused: str = ""             # why model.bias=true is refused; "": accepted
    hf: Optional[HFConfig] = None
    hf_weights: Optional[HFWeights] = None

    def __post_init__(self) -> None:
        mod, _, cls = self.module.partition(":")
        if not (self.name and mod and cls):
            raise ValueError(f"ArchSpec {self.name!r}: module={self.module!r} is not "
                             f"'package.module:Class'")
        if self.norm not in NORMS:
            raise ValueError(f"ArchSpec {self.name!r}: norm={self.norm!r} is not one of "
                             f"{', '.join(NORMS)}")
        if (self.hf is None) != (self.hf_weights is None):
            raise ValueError(f"ArchSpec {self.name!r}: hf and hf_weights come together")
        if self.hf_weights is not None and \
                (len(self.hf_weights.mlp_in) == 2) != self.gated_mlp:
            raise ValueError(f"ArchSpec {self.name!r}: hf_weights.mlp_in="
                             f"{self.hf_weights.mlp_in} for gated_mlp={self.gated_mlp}")
        for size, fields in self.sizes.items():
            if "arch" in fields:
                raise ValueError(f"ArchSpec {self.name!r}: size {size!r} names an arch; "
                                 f"a spec's sizes are its own")

    @property
    def rotary(self) -> bool:
        return not self.learned_positions

    def norm_params(self, d_model: int) -> int:
        """One norm's parameters."""
        return NORMS[self.norm] * d_model

    def unused_fields(self) -> tuple[str, ...]:
        """ModelConfig fields this architecture ignores (an HF import does not compare them)."""
        return ROPE_FIELDS if self.learned_positions else ()
