"""Errors that mean "the user's input is wrong" rather than "oases has a bug".

Anything raised as :class:`UserError` is reported by ``train.py`` (and the other
entry points) as one line on stderr with exit status 2, and no traceback unless
``debug=true``.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input: config, data, checkpoint, plan or directory. Exit status 2."""


class ConfigError(UserError):
    """The config (YAML or a dotted override) is invalid."""


class DataError(UserError):
    """A data file is missing, too short or malformed."""


class CheckpointError(UserError):
    """A checkpoint is missing, partial, corrupt or does not match the model."""


EXIT_USER_ERROR = 2
