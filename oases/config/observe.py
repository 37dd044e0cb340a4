"""Config sections for watching a run: W&B, TensorBoard, the profiler
(:mod:`oases.runtime.metrics`, :mod:`oases.runtime.profiling`; docs/observability.md).
They are the ``wandb``, ``metrics`` and ``profile`` sections of :class:`oases.config.Config`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from oases.config.section import choice, Section
from oases.errors import ConfigError


@dataclass
class WandbConfig(Section):
    mode: str = "offline"           # "offline" | "online" | "disabled"
    project: str = "oases"
    name: str = ""                  # run name; default: the out_dir's name
    entity: str = ""                # team or user; default: the API key's
    group: str = ""                 # runs grouped together in the UI; default: the layout
    tags: list = field(default_factory=list)
    notes: str = ""

    def validate(self) -> None:
        choice("wandb.mode", self.mode, ("offline", "online", "disabled"))
        if not isinstance(self.tags, list) or not all(isinstance(t, str) for t in self.tags):
            raise ConfigError(f"wandb.tags={self.tags!r} must be a list of strings")


@dataclass
class MetricsConfig(Section):
    tensorboard: bool = False       # also write the scalars to <out_dir>/tensorboard
    # time every TP collective's wait and lifetime (tp_comm_exposed_s, tp_comm_hidden_frac;
    # oases.overlap.comm_clock): a few stamps and a completion callback per collective
    comm_clock: bool = True

    def validate(self) -> None:
        pass


@dataclass
class ProfileConfig(Section):
    # [a, b]: record optimizer steps a..b (1-based, inclusive) with torch.profiler on
    # every rank to <out_dir>/profile/rank<k>.json. Empty: no profiling.
    steps: list = field(default_factory=list)
    memory_snapshot: bool = False   # CUDA: also dump <out_dir>/profile/memory_rank<k>.pickle

    def window(self) -> Optional[tuple[int, int]]:
        return (int(self.steps[0]), int(self.steps[1])) if self.steps else None

    def validate(self, total_steps: int) -> None:
        s = self.steps
        if not s:
            if self.memory_snapshot:
                raise ConfigError("profile.memory_snapshot needs profile.steps=[a,b]")
            return
        if (len(s) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in s)
                or not 1 <= s[0] <= s[1]):
            raise ConfigError(f"profile.steps={s!r} must be [a, b] with 1 <= a <= b")
        if s[1] > total_steps:
            raise ConfigError(f"profile.steps={s!r} ends after the run's last step "
                              f"(train.steps={total_steps})")
