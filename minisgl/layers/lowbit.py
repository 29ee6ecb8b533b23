"""Integer (4/8-bit, group-scaled) linear weights, `minisgl.kernels.lowbit.QWeight`: a layer
gathers its checkpoint parts while loading (integer parts as the checkpoint has them; 16/32-bit
ones quantized round-to-nearest per group with `--quantization int4|int8`) and packs them for
its device's kernel once loading ends. A layer the kernels cannot take (a float part in a GGUF,
Q6_K's groups of 16 on the CPU, a shape the kernel refuses) is dequantized to the model dtype,
as before integer weights had kernels, and says so once per reason.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.config import QuantConfig
from minisgl.kernels.lowbit import QWeight, join, pick_group, quantize_rtn
from minisgl.kernels.lowbit.cpu import CpuLowBit
from minisgl.layers.weight_format import Place

logger = logging.getLogger(__name__)

__all__ = ["LowBitParts", "QWeight"]


@functools.cache
def _say_once(message: str) -> None:
    logger.warning(message)


def _kernel(w: QWeight, device: torch.device) -> Any:
    """The packed weight's matmul on `device` (`kernel(x, bias)`, `.packed`, `.scales`), or why
    there is none."""
    if w.group > 256:  # per channel (compressed-tensors): the same scales repeated
        w = w.regroup(pick_group(w.group, 128))
    perm = None if w.perm is None else w.perm.to(device)
    w = QWeight(w.q.to(device), w.scales.to(device), w.mins.to(device), perm)
    if device.type == "cuda":
        from minisgl.kernels.lowbit.triton import TritonLowBit

        return TritonLowBit.pack(w) if TritonLowBit.supports(w) else f"group {w.group} on CUDA"
    if not CpuLowBit.supports(w):
        return f"group {w.group} / {w.q.shape[0]} rows on the CPU"
    return CpuLowBit.pack(w)


class LowBitParts:
    """One layer's integer weight: parts while loading, then its kernel (or a float weight)."""

    def __init__(self, rows: int, cols: int, quant: QuantConfig) -> None:
        self.rows, self.cols, self.quant = rows, cols, quant
        self.dtype = torch.get_default_dtype()  # of a dequantized fallback
        self.device = torch.empty(0).device  # the model's (built under `torch.device`)
        self.parts: list[tuple[int, QWeight | torch.Tensor]] = []  # (first row, part)
        self.kernel: Any = None  # CpuLowBit or TritonLowBit once loaded

    def placeholder(self, loader: Callable[..., None]) -> nn.Parameter:
        """The layer's `weight` until loading ends: [rows, cols] uint8, no memory behind it."""
        empty = torch.zeros(1, 1, dtype=torch.uint8, device=self.device)
        empty = empty.expand(self.rows, self.cols)
        p = nn.Parameter(empty, requires_grad=False)
        p.weight_loader = loader  # type: ignore[attr-defined]
        return p

    def add(self, part: Any, place: Place) -> None:
        """A whole checkpoint part (QWeight, or 16/32-bit) and where this rank's share lands."""
        if not isinstance(part, QWeight) and self.quant.source == "online":  # whole, then sharded
            part = quantize_rtn(part.to(self.device), self.quant.bits, self.quant.group)
        rows, cols = (place.src_row, place.rows), (place.src_col, place.cols)
        if isinstance(part, QWeight):
            part = part.narrow(rows, cols)
        else:
            part = part.narrow(0, *rows).narrow(1, *cols)
        self.parts.append((place.dst_row, part))

    def finish(self, what: str) -> tuple[nn.Parameter, nn.Parameter | None]:
        """Pack the parts for the kernel; returns the layer's new `weight` and its scales (None:
        dequantized)."""
        device = self.device
        parts = [p for _, p in sorted(self.parts, key=lambda rp: rp[0])]
        self.parts = []
        if sum(p.shape[0] for p in parts) != self.rows:
            raise ValueError(f"{what}: the checkpoint's parts do not cover its {self.rows} rows")
        ints = [p for p in parts if isinstance(p, QWeight)]
        kernel: Any = "a 16/32-bit part" if len(ints) < len(parts) else _kernel(join(ints), device)
        if isinstance(kernel, str):
            _say_once(f"integer weights with {kernel}: no kernel, dequantized to {self.dtype}")
            w = [p.dequantize(self.dtype) if isinstance(p, QWeight) else p for p in parts]
            full = torch.cat(w).to(device, self.dtype)
            if device.type == "cpu":  # [in, out] memory, as `linear._weight` keeps it for MKL
                full = full.t().contiguous().t()
            return nn.Parameter(full, requires_grad=False), None
        self.kernel = kernel
        scales = nn.Parameter(kernel.scales, requires_grad=False)
        return nn.Parameter(kernel.packed, requires_grad=False), scales

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        if self.kernel is None:
            return F.linear(x, weight, bias)
        return self.kernel(x, bias)  # type: ignore[no-any-return]
