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
from minisgl.config.server import Deadlines, Limits, ServerConfig

__all__ = [
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "ChatConfig",
    "resolve_chat_template",
    "DTYPES",
    "SCHEDULE_POLICIES",
    "SPECULATIVE_ALGORITHMS",
    "Deadlines",
    "EngineConfig",
    "Limits",
    "ModelConfig",
    "MoEConfig",
    "QuantConfig",
    "RopeConfig",
    "ServerConfig",
    "apply_env_switches",
    "model_config_from_dict",
    "resolve_engine_config",
    "resolve_model_quantization",
]
