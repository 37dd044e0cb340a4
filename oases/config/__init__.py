"""The run's configuration: typed dataclasses (the single source of truth), YAML and
dotted overrides, data blends, named model sizes and the Hugging Face config mapping.

The floor every other package stands on: it imports nothing of oases but ``errors``."""

from oases.config.schema import (CheckpointConfig, Config, DataConfig, EvalConfig, ModelConfig,
                                 ParallelConfig, TrainConfig, WandbConfig, load_config, save_config)
from oases.errors import ConfigError

__all__ = ["CheckpointConfig", "Config", "ConfigError", "DataConfig", "EvalConfig",
           "ModelConfig", "ParallelConfig", "TrainConfig", "WandbConfig", "load_config",
           "save_config"]
