"""Read a local Hugging Face model directory's ``config.json`` as oases model fields,
and write one for a model: each architecture's mapping is its spec's ``hf``
(:class:`~oases.config.arch.HFConfig`, in ``oases/config/archs/``).

Pure (json only, no torch): ``oases.config`` uses it to resolve
``model.init_from=hf:<dir>``, and ``oases.models.hf`` to check the weights against it
and to export.

    hf_model_fields("ckpt/gpt2")  ->  {"arch": "gpt", "n_layer": 12, "d_model": 768, ...}

Supported: every registered architecture with a mapping (built in: ``GPT2LMHeadModel``,
``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MistralForCausalLM``), with RoPE types
default, linear, dynamic and llama3. Anything oases cannot reproduce exactly (another
activation, biased LLaMA projections, YaRN, Qwen2's windowed layers, ...) is refused
with a one-line :class:`~oases.errors.ConfigError` naming the field rather than
imported approximately.
"""

from __future__ import annotations

import json
from pathlib import Path

from oases.config.arch import ArchSpec
from oases.config.archs import get_arch, hf_archs
from oases.errors import ConfigError, UserError

# Fields whose value comes from config.json (all of ModelConfig's shape fields).
HF_FIELDS = ("arch", "n_layer", "d_model", "n_head", "n_kv_heads", "ffn_hidden", "vocab_size",
             "seq_len", "norm_eps", "rope_theta", "rope_type", "rope_factor",
             "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len",
             "sliding_window", "tie_embeddings", "bias")


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


def hf_arch_of(cfg: dict, where: str) -> ArchSpec:
    """The architecture a parsed config.json is: by ``architectures[0]`` (which must
    agree with ``model_type``), else by ``model_type``."""
    specs = hf_archs()
    supported = ", ".join(s.hf.architecture for s in specs)
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    if archs:
        name = archs[0]
        spec = next((s for s in specs if s.hf.architecture == name), None)
        if spec is None:
            raise ConfigError(f"{where}: unsupported architecture {name} "
                              f"(supported: {supported})")
        if model_type is not None and model_type != spec.hf.model_type:
            raise ConfigError(f"{where}: config.json says architecture {name} but "
                              f"model_type {model_type!r}")
        return spec
    spec = next((s for s in specs if s.hf.model_type == model_type), None)
    if spec is None:
        raise ConfigError(f"{where}: unsupported architecture {model_type or '<none>'} "
                          f"(supported: {supported})")
    return spec


def hf_model_fields(hf_dir: str | Path) -> dict:
    """ModelConfig shape fields from ``<hf_dir>/config.json`` (see :data:`HF_FIELDS`)."""
    where = f"init_from hf:{hf_dir}"
    cfg = read_hf_config(hf_dir)
    spec = hf_arch_of(cfg, where)
    fields = dict(spec.hf.read(cfg, where), arch=spec.name)
    if set(fields) != set(HF_FIELDS):  # a mapping bug, not the user's
        raise RuntimeError(f"arch {spec.name}'s config.json mapping gives "
                           f"{sorted(set(fields) ^ set(HF_FIELDS))} wrongly")
    return {k: fields[k] for k in HF_FIELDS}


def hf_config_dict(model_cfg) -> dict:
    """``config.json`` contents for a resolved oases ``ModelConfig``."""
    hf = get_arch(model_cfg.arch).hf
    if hf is None:
        raise UserError(f"model.arch={model_cfg.arch!r} has no Hugging Face export")
    return {"architectures": [hf.architecture], "model_type": hf.model_type,
            **hf.write(model_cfg)}


def apply_init_from(model_cfg) -> None:
    """Fill a ``ModelConfig``'s shape fields from ``model.init_from=hf:<dir>``.

    The HF config wins: a field the user left unset takes its value; a field the user
    set to something else is an error naming both values, except ``seq_len``, which may
    be set smaller than the checkpoint's maximum (positions beyond it are not loaded),
    and the fields the architecture ignores.
    """
    if not model_cfg.init_from:
        return
    hf_dir = hf_dir_of(model_cfg.init_from)
    fields = hf_model_fields(hf_dir)
    unused = get_arch(fields["arch"]).unused_fields()
    for k in HF_FIELDS:
        hf, mine = fields[k], getattr(model_cfg, k)
        if mine is None:
            setattr(model_cfg, k, hf)
            continue
        if k == "seq_len" and 0 < mine <= hf:
            continue
        if k in unused:
            continue
        same = (float(mine) == float(hf)) if isinstance(hf, float) else mine == hf
        if not same:
            extra = " (it may be smaller, not larger)" if k == "seq_len" else ""
            raise ConfigError(f"model.{k}={mine} disagrees with {k}={hf} from "
                              f"hf:{hf_dir}/config.json{extra}; drop the override")
