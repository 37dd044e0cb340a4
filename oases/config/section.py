"""The base of every config section (:mod:`oases.config.schema`) and the checks they share."""

from __future__ import annotations

import dataclasses
from typing import Any

from oases.errors import ConfigError


class Section:
    """A config section that can be frozen: once a run has validated its config, every
    value the run derives lives in its state, and a write into the config is a bug that
    fails where it happens (:meth:`Config.freeze`)."""

    def __setattr__(self, name: str, value) -> None:
        if self.__dict__.get("_frozen"):
            raise dataclasses.FrozenInstanceError(
                f"the config is frozen after validation: cannot set {type(self).__name__}"
                f".{name}; derive a new config with Config.with_changes")
        super().__setattr__(name, value)

    def _set_frozen(self, frozen: bool) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Section):
                v._set_frozen(frozen)
        object.__setattr__(self, "_frozen", frozen)


def choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(map(str, choices))}")


def positive(name: str, value, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0  # False for NaN too
    if not ok:
        raise ConfigError(f"{name}={value} must be {'>= 0' if allow_zero else '> 0'}")
