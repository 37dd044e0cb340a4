"""Typed reads of a Hugging Face ``config.json`` and its RoPE, both spellings: the pieces
every architecture's mapping (:mod:`oases.config.archs`) is written with. Pure (json
only, no torch); a value oases cannot take is a one-line
:class:`~oases.errors.ConfigError` naming the key, prefixed by ``where``.
"""

from __future__ import annotations

import json
import math
from typing import Any

from oases.errors import ConfigError

# the RoPE types oases reproduces (oases.models.rope), by transformers' names
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
# RoPE and window fields where a config says nothing (original_max_len: the model's length)
ROPE_DEFAULTS = dict(rope_type="default", rope_factor=1.0, rope_low_freq_factor=1.0,
                     rope_high_freq_factor=4.0)


def hf_get(cfg: dict, key: str, where: str, default: Any = ...) -> Any:
    """``cfg[key]``; absent or null: ``default``, or an error when there is none."""
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if default is ...:
        raise ConfigError(f"{where}: config.json has no {key!r}")
    return default


def hf_int(cfg: dict, key: str, where: str, default: Any = ...) -> int:
    """``cfg[key]`` as an int: a JSON integer (or a float with an integral value), not a
    string, a bool or a fraction."""
    return hf_number(hf_get(cfg, key, where, default), key, where, int)


def hf_float(cfg: dict, key: str, where: str, default: Any = ...) -> float:
    return hf_number(hf_get(cfg, key, where, default), key, where, float)


def hf_number(v: Any, key: str, where: str, kind: type) -> Any:
    ok = (isinstance(v, int) and not isinstance(v, bool)
          or isinstance(v, float) and math.isfinite(v) and (kind is float or v == int(v)))
    if not ok:
        what = "an integer" if kind is int else "a finite number"
        raise ConfigError(f"{where}: config.json's {key}={json.dumps(v)} is not {what}")
    return kind(v)


def hf_bool(cfg: dict, key: str, where: str, default: bool) -> bool:
    v = hf_get(cfg, key, where, default)
    if not isinstance(v, bool):
        raise ConfigError(f"{where}: config.json's {key}={json.dumps(v)} is not true or false")
    return v


def rope_fields(cfg: dict, where: str, max_pos: int) -> dict:
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
    theta = hf_number(theta if theta is not None else 10000.0, "rope_theta", where, float)
    out = dict(ROPE_DEFAULTS, rope_theta=theta, rope_type=kind, rope_original_max_len=max_pos)
    need = {"linear": ("factor",), "dynamic": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings")}.get(kind, ())
    for k in need:
        if params.get(k) is None:
            raise ConfigError(f"{where}: rope_type={kind!r} needs {k} in rope_scaling")
    if need:
        out["rope_factor"] = hf_float(params, "factor", where)
    if kind == "llama3":
        out.update(rope_low_freq_factor=hf_float(params, "low_freq_factor", where),
                   rope_high_freq_factor=hf_float(params, "high_freq_factor", where),
                   rope_original_max_len=hf_int(params, "original_max_position_embeddings",
                                                where))
    return out


def rope_json(c) -> dict:
    """A ModelConfig's RoPE as both spellings: ``rope_theta`` + ``rope_scaling``
    (transformers < 5, published Llama 3.x) and ``rope_parameters`` (transformers >= 5)."""
    rp = {"rope_type": c.rope_type, "rope_theta": c.rope_theta}
    if c.rope_type != "default":
        rp["factor"] = c.rope_factor
    if c.rope_type == "llama3":
        rp.update(low_freq_factor=c.rope_low_freq_factor, high_freq_factor=c.rope_high_freq_factor,
                  original_max_position_embeddings=c.rope_original_max_len)
    scaling = None if c.rope_type == "default" else {k: v for k, v in rp.items()
                                                      if k != "rope_theta"}
    return {"rope_theta": c.rope_theta, "rope_scaling": scaling, "rope_parameters": rp}
