"""The base of every config section (:mod:`oases.config.schema`)."""

from __future__ import annotations

import dataclasses


class _Section:
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
            if isinstance(v, _Section):
                v._set_frozen(frozen)
        object.__setattr__(self, "_frozen", frozen)
