"""Frozen configs, resolved once by pure functions."""

from minisgl.config.chat import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    ChatConfig,
    resolve_chat_template,
)
from minisgl.config.engine import (
    DTYPES,
    SCHEDULE_POLICIES,
    SPECULATIVE_ALGORITHMS,
    EngineConfig,
    apply_env_switches,
    resolve_engine_config,
    resolve_model_quantization,
)
from minisgl.config.model import ModelConfig, MoEConfig, RopeConfig, model_config_from_dict
from minisgl.config.quant import QuantConfig

__all__ = [
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "ChatConfig",
    "resolve_chat_template",
    "DTYPES",
    "SCHEDULE_POLICIES",
    "SPECULATIVE_ALGORITHMS",
    "EngineConfig",
    "ModelConfig",
    "MoEConfig",
    "QuantConfig",
    "RopeConfig",
    "apply_env_switches",
    "model_config_from_dict",
    "resolve_engine_config",
    "resolve_model_quantization",
]
