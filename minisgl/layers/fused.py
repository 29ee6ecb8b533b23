"""Whether a layer runs its fused Triton kernel (`minisgl.kernels.fused`): for CUDA tensors when
Triton is installed, unless `MINISGL_DISABLE_FUSED=1`. The torch code beside each call stays
the reference (and the CPU path)."""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

ENV_DISABLE_FUSED = "MINISGL_DISABLE_FUSED"


@functools.cache
def _kernels() -> ModuleType | None:
    if os.environ.get(ENV_DISABLE_FUSED) == "1":
        return None
    try:
        from minisgl.kernels import fused
    except ImportError:
        return None
    return fused


def fused_kernels(x: torch.Tensor) -> ModuleType | None:
    """The fused-kernel module for tensors like `x`, or None to run the torch code."""
    return _kernels() if x.is_cuda else None
