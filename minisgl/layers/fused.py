"""Whether a layer runs its fused Triton kernel (`minisgl.kernels.fused`): for CUDA tensors when
Triton is installed, unless `MINISGL_DISABLE_FUSED=1`. The torch code beside each call stays
the reference (and the CPU path); `set_fused_enabled(False)` runs it on CUDA too (tests).
A CUDA graph keeps the path that was on when it was captured."""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from minisgl.config import env


class _Switch:
    """Process-wide on/off for the fused kernels (tests compare them with the torch layers)."""

    enabled = True


_SWITCH = _Switch()


def set_fused_enabled(enabled: bool) -> None:
    _SWITCH.enabled = enabled


def reset_fused() -> None:
    _SWITCH.enabled = True


@functools.cache
def _kernels() -> ModuleType | None:
    if env.DISABLE_FUSED.get():
        return None
    try:
        from minisgl.kernels import fused
    except ImportError:
        return None
    return fused


def fused_kernels(x: torch.Tensor) -> ModuleType | None:
    """The fused-kernel module for tensors like `x`, or None to run the torch code."""
    return _kernels() if x.is_cuda and _SWITCH.enabled else None
