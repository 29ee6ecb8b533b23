"""A model built on the engine's device and dtype, with its weights (the target's and a draft
model's)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from minisgl.config import EngineConfig, ModelConfig
from minisgl.layers.linear import set_batch_invariant
from minisgl.models import build_model
from minisgl.weights import ModelSource, init_dummy_weights, load_weights
from minisgl.weights.fp8 import KVScales


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    cfg: EngineConfig, mcfg: ModelConfig, src: ModelSource, seed: int
) -> tuple[nn.Module, KVScales | None]:
    """The model in eval mode, its weights loaded (random ones from `seed` with the dummy load
    format), and the checkpoint's FP8 KV scales if it has any."""
    with torch.device(cfg.torch_device), _default_dtype(cfg.torch_dtype):
        model = build_model(mcfg)
    kv_scales = None
    if cfg.load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        kv_scales = load_weights(model, src, mcfg)
    if cfg.deterministic:
        set_batch_invariant(model)
    model.eval()
    return model, kv_scales
