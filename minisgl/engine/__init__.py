"""The engine: model, KV pool and one call per step (`forward_batch`)."""

from minisgl.engine.engine import Engine
from minisgl.engine.step import ForwardOutput

__all__ = ["Engine", "ForwardOutput"]
