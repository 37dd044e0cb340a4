"""A training run's state on this rank: what every step reads and updates, as one object.

:func:`oases.runtime.build.build_train_state` builds it; :func:`oases.runtime.step.train_step`
and :func:`~oases.runtime.step.evaluate` take it. The config inside is frozen (validated
once); what a run derives from it lives here, not written back into the config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from oases.config import Config
from oases.dp.reducer import GradReducer
from oases.overlap.engines import MegatronEngine
from oases.parallel.engine import Engine
from oases.parallel.groups import ParallelContext
from oases.pipeline.runner import PipelineRunner


@dataclass
class StepStats:
    """What a step measured beyond loss and norm: the fraction of the step the ranks
    spent outside F/B compute (the pipeline bubble, mean over all ranks; 0 at pp=1)."""
    bubble: float = 0.0


@dataclass
class TrainState:
    """Model, optimizer, gradient reducer, TP engine and (pp > 1) pipeline runner of one
    rank, with the config and groups they were built for. ``engine`` None: the megatron
    engine (plain autograd)."""
    cfg: Config
    ctx: ParallelContext
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    reducer: GradReducer
    engine: Optional[Engine] = None
    pipe: Optional[PipelineRunner] = None
    stats: StepStats = field(default_factory=StepStats)

    def __post_init__(self) -> None:
        if self.engine is None:
            self.engine = MegatronEngine()
