"""Model sources and weight loading: safetensors, GGUF (dequantised through `gguf`), dummy."""

from minisgl.weights.loader import init_dummy_weights, load_weights
from minisgl.weights.source import (
    ModelNotFoundError,
    ModelSource,
    default_model_path,
    fetch_model,
    load_model_config,
    load_tokenizer,
    resolve_source,
)

__all__ = [
    "ModelNotFoundError",
    "ModelSource",
    "default_model_path",
    "fetch_model",
    "init_dummy_weights",
    "load_model_config",
    "load_tokenizer",
    "load_weights",
    "resolve_source",
]
