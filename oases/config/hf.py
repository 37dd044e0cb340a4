"""Read a local Hugging Face model directory's ``config.json`` as oases model fields.

Pure (json only, no torch): ``oases.config`` uses it to resolve
``model.init_from=hf:<dir>``, and ``oases.models.hf`` to check the weights against it.

    hf_model_fields("ckpt/gpt2")  ->  {"arch": "gpt", "n_layer": 12, "d_model": 768, ...}

Supported: ``GPT2LMHeadModel`` (``model_type: gpt2``), ``LlamaForCausalLM``
(``llama``), ``Qwen2ForCausalLM`` (``qwen2``) and ``MistralForCausalLM`` (``mistral``),
with RoPE types default, linear, dynamic and llama3. Anything oases cannot reproduce
exactly (another activation, biased LLaMA projections, YaRN, Qwen2's windowed layers,
...) is refused with a one-line :class:`~oases.errors.ConfigError` naming the field
rather than imported approximately.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from oases.errors import ConfigError

# config.json model_type -> architecture; oases' model.arch is the model_type, "gpt" for gpt2
_MODEL_TYPES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
SUPPORTED = tuple(_MODEL_TYPES.values())
# the LLaMA-like architectures and the oases model.arch of each
LLAMA_ARCHS = {name: t for t, name in _MODEL_TYPES.items() if t != "gpt2"}

# Fields whose value comes from config.json (all of ModelConfig's shape fields).
HF_FIELDS = ("arch", "n_layer", "d_model", "n_head", "n_kv_heads", "ffn_hidden", "vocab_size",
             "seq_len", "norm_eps", "rope_theta", "rope_type", "rope_factor",
             "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len",
             "sliding_window", "tie_embeddings", "bias")
# ... of which a GPT (learned positions) has no use
GPT_UNUSED = ("rope_theta", "rope_type", "rope_factor", "rope_low_freq_factor",
              "rope_high_freq_factor", "rope_original_max_len")
# the RoPE types oases reproduces (oases.models.rope), by transformers' names
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
# RoPE and window fields where a config says nothing (original_max_len: the model's length)
ROPE_DEFAULTS = dict(rope_type="default", rope_factor=1.0, rope_low_freq_factor=1.0,
                     rope_high_freq_factor=4.0)


def hf_dir_of(init_from: str) -> str:
    """``"hf:<dir>"`` -> ``"<dir>"``; anything else is a config error."""
    if not init_from.startswith("hf:") or not init_from[3:]:
        raise ConfigError(f"model.init_from={init_from!r} is not of the form hf:<dir> "
                          f"(a local Hugging Face model directory)")
    return init_from[3:]


def read_hf_config(hf_dir: str | Path) -> dict:
    """The parsed ``<hf_dir>/config.json``; a missing directory or file is an error."""
    d = Path(hf_dir)
    where = f"init_from hf:{hf_dir}"
    if not d.exists():
        raise ConfigError(f"{where}: directory does not exist")
    if not d.is_dir():
        raise ConfigError(f"{where}: not a directory")
    path = d / "config.json"
    if not path.is_file():
        raise ConfigError(f"{where}: no config.json (expected a directory written by "
                          f"save_pretrained)")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{where}: config.json is not readable JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: config.json is not a JSON object")
    return cfg


def _get(cfg: dict, key: str, where: str, default: Any = ...) -> Any:
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if default is ...:
        raise ConfigError(f"{where}: config.json has no {key!r}")
    return default


def _int(cfg: dict, key: str, where: str, default: Any = ...) -> int:
    """``cfg[key]`` as an int: a JSON integer (or a float with an integral value), not a
    string, a bool or a fraction."""
    return _number(_get(cfg, key, where, default), key, where, int)


def _float(cfg: dict, key: str, where: str, default: Any = ...) -> float:
    return _number(_get(cfg, key, where, default), key, where, float)


def _number(v: Any, key: str, where: str, kind: type) -> Any:
    ok = (isinstance(v, int) and not isinstance(v, bool)
          or isinstance(v, float) and math.isfinite(v) and (kind is float or v == int(v)))
    if not ok:
        what = "an integer" if kind is int else "a finite number"
        raise ConfigError(f"{where}: config.json's {key}={json.dumps(v)} is not {what}")
    return kind(v)


def _bool(cfg: dict, key: str, where: str, default: bool) -> bool:
    v = _get(cfg, key, where, default)
    if not isinstance(v, bool):
        raise ConfigError(f"{where}: config.json's {key}={json.dumps(v)} is not true or false")
    return v


def _architecture(cfg: dict, where: str) -> str:
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    if archs:
        name = archs[0]
        if name not in SUPPORTED:
            raise ConfigError(f"{where}: unsupported architecture {name} "
                              f"(supported: {', '.join(SUPPORTED)})")
        if model_type is not None and _MODEL_TYPES.get(model_type) != name:
            raise ConfigError(f"{where}: config.json says architecture {name} but "
                              f"model_type {model_type!r}")
        return name
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise ConfigError(f"{where}: unsupported architecture {model_type or '<none>'} "
                      f"(supported: {', '.join(SUPPORTED)})")


def _gpt2(cfg: dict, where: str) -> dict:
    act = _get(cfg, "activation_function", where, "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(f"{where}: activation_function={act!r} is not supported "
                          f"(oases GPT uses tanh GELU: gelu_new or gelu_pytorch_tanh)")
    if cfg.get("scale_attn_by_inverse_layer_idx"):
        raise ConfigError(f"{where}: scale_attn_by_inverse_layer_idx=true is not supported")
    if cfg.get("scale_attn_weights") is False:
        raise ConfigError(f"{where}: scale_attn_weights=false is not supported")
    if cfg.get("add_cross_attention"):
        raise ConfigError(f"{where}: add_cross_attention=true is not supported")
    d = _int(cfg, "n_embd", where)
    return dict(arch="gpt", n_layer=_int(cfg, "n_layer", where), d_model=d,
                n_head=_int(cfg, "n_head", where),
                n_kv_heads=_int(cfg, "n_head", where),
                ffn_hidden=_int(cfg, "n_inner", where, 4 * d),
                vocab_size=_int(cfg, "vocab_size", where),
                seq_len=_int(cfg, "n_positions", where),
                norm_eps=_float(cfg, "layer_norm_epsilon", where, 1e-5),
                **_rope({}, where, _int(cfg, "n_positions", where)),  # unused by GPT
                sliding_window=0,
                tie_embeddings=_bool(cfg, "tie_word_embeddings", where, True),
                bias=True)


def _rope(cfg: dict, where: str, max_pos: int) -> dict:
    """The RoPE fields from ``rope_scaling`` + ``rope_theta`` (transformers < 5, published
    Llama 3.x) or ``rope_parameters`` (transformers >= 5); both where they agree."""
    params: dict = {}
    for key in ("rope_scaling", "rope_parameters"):
        got = cfg.get(key)
        if got is None:
            continue
        if not isinstance(got, dict):
            raise ConfigError(f"{where}: {key}={got!r} is not a JSON object")
        got = dict(got)
        if "type" in got and "rope_type" not in got:
            got["rope_type"] = got.pop("type")
        for k, v in got.items():
            if k in params and params[k] != v:
                raise ConfigError(f"{where}: rope_scaling and rope_parameters disagree on "
                                  f"{k} ({params[k]!r} vs {v!r})")
            params[k] = v
    kind = params.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise ConfigError(f"{where}: rope_type={kind!r} is not supported "
                          f"(supported: {', '.join(ROPE_TYPES)})")
    prf = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if prf != 1.0:
        raise ConfigError(f"{where}: partial_rotary_factor={prf} is not supported "
                          f"(oases rotates the whole head)")
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    theta = _number(theta if theta is not None else 10000.0, "rope_theta", where, float)
    out = dict(ROPE_DEFAULTS, rope_theta=theta, rope_type=kind, rope_original_max_len=max_pos)
    need = {"linear": ("factor",), "dynamic": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings")}.get(kind, ())
    for k in need:
        if params.get(k) is None:
            raise ConfigError(f"{where}: rope_type={kind!r} needs {k} in rope_scaling")
    if need:
        out["rope_factor"] = _float(params, "factor", where)
    if kind == "llama3":
        out.update(rope_low_freq_factor=_float(params, "low_freq_factor", where),
                   rope_high_freq_factor=_float(params, "high_freq_factor", where),
                   rope_original_max_len=_int(params, "original_max_position_embeddings",
                                              where))
    return out


def _llama(cfg: dict, where: str, arch: str) -> dict:
    """LLaMA, Qwen2 (q/k/v biases) and Mistral (sliding window) configs."""
    name = LLAMA_ARCHS[arch]
    if name == "llama":
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key):
                raise ConfigError(f"{where}: {key}=true is not supported (oases LLaMA has no "
                                  f"projection biases)")
    act = _get(cfg, "hidden_act", where, "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act={act!r} is not supported (SwiGLU needs silu)")
    d = _int(cfg, "hidden_size", where)
    n_head = _int(cfg, "num_attention_heads", where)
    head_dim = _int(cfg, "head_dim", where, None) if cfg.get("head_dim") is not None else None
    if head_dim is not None and n_head and head_dim * n_head != d:
        raise ConfigError(f"{where}: head_dim={head_dim} x num_attention_heads={n_head} != "
                          f"hidden_size={d} is not supported")
    n_layer = _int(cfg, "num_hidden_layers", where)
    window = 0
    if name == "qwen2":
        sliding = [t for t in cfg.get("layer_types") or () if t != "full_attention"]
        if cfg.get("use_sliding_window") and _int(cfg, "max_window_layers", where, 0) < n_layer:
            raise ConfigError(f"{where}: use_sliding_window=true is not supported (Qwen2's "
                              f"windowed layers from max_window_layers on)")
        if sliding:
            raise ConfigError(f"{where}: layer_types={sliding[0]!r} is not supported "
                              f"(every layer attends fully)")
    elif name == "mistral":
        window = _int(cfg, "sliding_window", where, 0)
    elif cfg.get("sliding_window"):
        raise ConfigError(f"{where}: sliding_window={cfg['sliding_window']} is not supported "
                          f"for {arch}")
    max_pos = _int(cfg, "max_position_embeddings", where)
    return dict(arch=name, n_layer=n_layer, d_model=d, n_head=n_head,
                n_kv_heads=_int(cfg, "num_key_value_heads", where, n_head),
                ffn_hidden=_int(cfg, "intermediate_size", where),
                vocab_size=_int(cfg, "vocab_size", where), seq_len=max_pos,
                norm_eps=_float(cfg, "rms_norm_eps", where, 1e-6),
                **_rope(cfg, where, max_pos), sliding_window=window,
                tie_embeddings=_bool(cfg, "tie_word_embeddings", where, False),
                bias=False)


def hf_model_fields(hf_dir: str | Path) -> dict:
    """ModelConfig shape fields from ``<hf_dir>/config.json`` (see :data:`HF_FIELDS`)."""
    where = f"init_from hf:{hf_dir}"
    cfg = read_hf_config(hf_dir)
    arch = _architecture(cfg, where)
    return _gpt2(cfg, where) if arch == "GPT2LMHeadModel" else _llama(cfg, where, arch)


def apply_init_from(model_cfg) -> None:
    """Fill a ``ModelConfig``'s shape fields from ``model.init_from=hf:<dir>``.

    The HF config wins: a field the user left unset takes its value; a field the user
    set to something else is an error naming both values, except ``seq_len``, which may
    be set smaller than the checkpoint's maximum (positions beyond it are not loaded).
    """
    if not model_cfg.init_from:
        return
    hf_dir = hf_dir_of(model_cfg.init_from)
    fields = hf_model_fields(hf_dir)
    for k in HF_FIELDS:
        hf, mine = fields[k], getattr(model_cfg, k)
        if mine is None:
            setattr(model_cfg, k, hf)
            continue
        if k == "seq_len" and 0 < mine <= hf:
            continue
        if k in GPT_UNUSED and fields["arch"] == "gpt":
            continue
        same = (float(mine) == float(hf)) if isinstance(hf, float) else mine == hf
        if not same:
            extra = " (it may be smaller, not larger)" if k == "seq_len" else ""
            raise ConfigError(f"model.{k}={mine} disagrees with {k}={hf} from "
                              f"hf:{hf_dir}/config.json{extra}; drop the override")
