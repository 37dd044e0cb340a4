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


def first_line(e: BaseException, limit: int | None = 160) -> str:
    """The first non-empty line of ``e``'s message (its type's name if it has none),
    cut at ``limit`` characters (None: whole)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    line = lines[0] if lines else type(e).__name__
    return line if limit is None or len(line) <= limit else line[:limit].rstrip() + "..."


class TrainingError(Exception):
    """The run cannot go on for a reason other than bad input (reported as one line;
    the exit status is ``exit_code``)."""

    exit_code = 1


class NonFiniteError(TrainingError):
    """A non-finite loss or gradient norm with ``train.on_nonfinite=stop``. Exit status 3."""

    exit_code = 3


class CollectiveError(TrainingError):
    """A collective failed or timed out (``parallel.timeout_s``): a peer rank died or
    hangs. Exit status 4."""

    exit_code = 4


class Preempted(TrainingError):
    """SIGTERM or SIGUSR1 arrived (a scheduler's notice before preemption or the time
    limit): the step in progress finished, a checkpoint was written, ``resume=auto``
    continues exactly. Exit status 5."""

    exit_code = 5


class CheckpointWriteError(TrainingError):
    """A checkpoint could not be written (disk full, an I/O error): every rank stops with
    the same line, and ``latest`` still names the last complete checkpoint. Exit status 6."""

    exit_code = 6


EXIT_NONFINITE = NonFiniteError.exit_code
EXIT_PREEMPTED = Preempted.exit_code
EXIT_COLLECTIVE = CollectiveError.exit_code
EXIT_CKPT_WRITE = CheckpointWriteError.exit_code
