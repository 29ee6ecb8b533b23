"""The engine: model, KV pool and one call per step (`forward_batch`)."""

from minisgl.engine.engine import Engine, ForwardOutput

__all__ = ["Engine", "ForwardOutput"]
