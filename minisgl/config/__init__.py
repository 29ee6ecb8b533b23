"""Frozen configs, resolved once by pure functions."""

from minisgl.config.engine import (
    DTYPES,
    EngineConfig,
    apply_env_switches,
    resolve_engine_config,
)
from minisgl.config.model import ModelConfig, MoEConfig, RopeConfig, model_config_from_dict

__all__ = [
    "DTYPES",
    "EngineConfig",
    "ModelConfig",
    "MoEConfig",
    "RopeConfig",
    "apply_env_switches",
    "model_config_from_dict",
    "resolve_engine_config",
]
