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
    EngineConfig,
    apply_env_switches,
    resolve_engine_config,
    resolve_model_quantization,
)
from minisgl.config.model import ModelConfig, RopeConfig, model_config_from_dict
from minisgl.config.quant import QuantConfig
from minisgl.config.server import ServerConfig

__all__ = [
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "ChatConfig",
    "resolve_chat_template",
    "DTYPES",
    "SCHEDULE_POLICIES",
    "EngineConfig",
    "ModelConfig",
    "QuantConfig",
    "RopeConfig",
    "ServerConfig",
    "apply_env_switches",
    "model_config_from_dict",
    "resolve_engine_config",
    "resolve_model_quantization",
]
