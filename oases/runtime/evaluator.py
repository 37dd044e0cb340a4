"""When a run evaluates: :class:`Evaluator` decides its own timing (``eval.interval`` and
the final step) and logs the validation loss (:func:`oases.runtime.step.evaluate`)."""

from __future__ import annotations

from typing import Optional

from oases.config import Config
from oases.parallel.groups import ParallelContext
from oases.runtime.data import ValBatches
from oases.runtime.metrics import MetricsLogger
from oases.runtime.state import TrainState
from oases.runtime.step import evaluate


class Evaluator:
    """The validation loss of ``val`` (None: no val file, nothing evaluated)."""

    def __init__(self, cfg: Config, ctx: ParallelContext, state: TrainState,
                 val: Optional[ValBatches], logger: MetricsLogger) -> None:
        self.cfg, self.ctx, self.state, self.val, self.logger = cfg, ctx, state, val, logger
        self.interval = cfg.eval.interval

    def __call__(self) -> float:
        return evaluate(self.state.model, self.val, self.cfg, self.ctx, self.state.pipe)

    def due(self, step: int) -> bool:
        return bool(self.interval) and step % self.interval == 0

    def maybe_eval(self, step: int) -> None:
        if self.val is not None and self.due(step):
            self.logger.log_eval(step, self())

    def final(self, step: int) -> None:
        """The last step's validation loss, unless the interval took it."""
        if self.val is not None and not self.due(step):
            self.logger.log_eval(step, self())
