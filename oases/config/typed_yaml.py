"""Dataclass trees from YAML, strictly: unknown keys (with the near miss), wrong types
and sections set as values are one-line :class:`ConfigError` s naming the key. The
config (:mod:`oases.config`) is built with it; nothing here knows its sections."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Optional

import yaml

from oases.errors import ConfigError


def _type_hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _coerce(key: str, value: Any, hint) -> Any:
    """Check (and gently coerce) one leaf value against its annotated type."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        for a in args[:-1]:  # Union[bool, str]: the first type that takes the value
            try:
                return _coerce(key, value, a)
            except ConfigError:
                pass
        return _coerce(key, value, args[-1])
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads "1e-3" as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # e.g. resume=0 or a numeric run name
    else:  # pragma: no cover - every field above has one of these types
        return value
    raise ConfigError(f"{key}={value!r} has the wrong type: expected {hint.__name__}, "
                      f"got {type(value).__name__}")


def _unknown(key: str, known) -> ConfigError:
    leaf = key.rsplit(".", 1)[-1]
    near = difflib.get_close_matches(leaf, list(known), n=1, cutoff=0.6)
    prefix = key.rsplit(".", 1)[0] + "." if "." in key else ""
    hint = f" (did you mean {prefix}{near[0]}?)" if near else ""
    return ConfigError(f"unknown config key {key!r}{hint}")


def build_dataclass(cls, data: dict, prefix: str = ""):
    if not isinstance(data, dict):
        raise ConfigError(f"config section {prefix.rstrip('.') or '<root>'} must be a mapping, "
                          f"got {type(data).__name__}")
    hints = _type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if k not in names:
            raise _unknown(key, names)
        hint = hints[k]
        if dataclasses.is_dataclass(hint):
            kwargs[k] = build_dataclass(hint, v if v is not None else {}, key + ".")
        else:
            kwargs[k] = _coerce(key, v, hint)
    return cls(**kwargs)


def set_dotted(root, key: str, raw: str) -> None:
    """Set ``a.b.c`` of a dataclass tree from the override text ``raw`` (parsed as YAML,
    strings kept verbatim), checked against the field's type."""
    parts = key.split(".")
    obj = root
    for i, part in enumerate(parts):
        names = {f.name for f in dataclasses.fields(obj)}
        if part not in names:
            raise _unknown(".".join(parts[: i + 1]), names)
        hint = _type_hints(type(obj))[part]
        if i < len(parts) - 1:
            if not dataclasses.is_dataclass(hint):
                raise ConfigError(f"{'.'.join(parts[: i + 1])} is a value, not a section "
                                  f"(in override {key}={raw})")
            obj = getattr(obj, part)
        else:
            if dataclasses.is_dataclass(hint):
                raise ConfigError(f"override {key}={raw} sets a whole section; set its keys")
            try:
                value = yaml.safe_load(raw) if raw != "" else ""
            except yaml.YAMLError:
                value = raw
            if hint is str or hint == Optional[str]:
                value = raw  # keep strings verbatim ("001" stays "001")
            setattr(obj, part, _coerce(key, value, hint))
