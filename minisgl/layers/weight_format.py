"""How a linear layer (or a stack of experts) stores its weight: in the model dtype, or in FP8
e4m3 with fp32 scales (`QuantConfig`), one per output channel or one per 128 x 128 block.

Checkpoint tensors reach a parameter as *parts* (a whole projection, or q / k / v, gate / up of a
fused one) and land in it by a `Place`, which each layer computes from its tensor-parallel rank.
An FP8 weight takes an e4m3 part as it is (its scales come as a part of their own) or quantizes
a 16/32-bit part whole, before any sharding, so every tensor-parallel size stores the same
values. FP8 weights stay e4m3 on every device; the reference path (CPU, or CUDA without the
fused kernels) dequantizes them on use, computing with exactly the e4m3 values times their
scales.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from minisgl.config import QuantConfig
from minisgl.kernels.fp8 import (
    BLOCK,
    FP8_DTYPE,
    dequantize_weight,
    is_fp8,
    quantize_blocks,
    quantize_rows,
)


class Place(NamedTuple):
    """Where a checkpoint part goes: `part[src_row : src_row + rows, src_col : src_col + cols]`
    lands in rows `[dst_row, dst_row + rows)` of the parameter (all of its columns)."""

    dst_row: int
    rows: int
    src_row: int
    src_col: int
    cols: int

    def in_blocks(self, what: str) -> Place:
        """The same place in units of 128 x 128 scale blocks; every edge must lie on a block edge
        (a partial last block is fine where the part ends)."""
        for name, value in (("row", self.dst_row), ("row", self.src_row), ("column", self.src_col)):
            if value % BLOCK:
                raise ValueError(
                    f"{what}: a tensor-parallel shard starts at {name} {value}, inside a "
                    f"{BLOCK} x {BLOCK} block of the FP8 checkpoint's scales; use a smaller "
                    "tp size (or a per-channel FP8 checkpoint)"
                )
        return Place(
            self.dst_row // BLOCK,
            math.ceil(self.rows / BLOCK),
            self.src_row // BLOCK,
            self.src_col // BLOCK,
            math.ceil(self.cols / BLOCK),
        )


def scale_shape(rows: int, cols: int, quant: QuantConfig) -> tuple[int, ...]:
    """[rows] per channel, or [ceil(rows/128), ceil(cols/128)] per block."""
    if quant.weight_block is None:
        return (rows,)
    return (math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))


def _slice(t: torch.Tensor, place: Place, columns: bool) -> torch.Tensor:
    t = t.narrow(0, place.src_row, place.rows)
    return t.narrow(1, place.src_col, place.cols) if columns else t


def copy_part(dst: torch.Tensor, part: torch.Tensor, place: Place, what: str) -> None:
    """`dst[place rows] = part[place]` (2-D parts; 1-D ones by rows only)."""
    src = _slice(part, place, columns=part.dim() > 1)
    target = dst.narrow(0, place.dst_row, place.rows)
    if target.shape != src.shape:
        raise ValueError(f"{what}: shape {tuple(src.shape)} does not fit {tuple(target.shape)}")
    target.copy_(src)


def quantize_part(part: torch.Tensor, quant: QuantConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole 16/32-bit checkpoint part [..., N, K] -> (e4m3, scales) in the layer's layout."""
    if quant.weight_block is None:
        return quantize_rows(part) if part.dim() == 2 else _quantize_stack_rows(part)
    return quantize_blocks(part)


def _quantize_stack_rows(part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [quantize_rows(p) for p in part]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def load_fp8_weight(
    weight: torch.Tensor,  # [N_local, K_local] e4m3
    scale: torch.Tensor,  # this layer's scales
    part: torch.Tensor,  # the checkpoint part: e4m3, or 16/32-bit to quantize
    place: Place,
    quant: QuantConfig,
    what: str,
) -> bool:
    """Store one part of an FP8 weight; True when its scales came with it (quantized here)."""
    if is_fp8(part.dtype):
        copy_part(weight, part, place, what)
        return False
    q, s = quantize_part(part.to(weight.device), quant)
    copy_part(weight, q, place, what)
    load_scale_part(scale, s, place, quant, what)
    return True


def load_scale_part(
    scale: torch.Tensor, part: torch.Tensor, place: Place, quant: QuantConfig, what: str
) -> None:
    """One part's scales: a single per-tensor value (fills the part's rows of a per-channel
    layout), one per row ([N] or [N, 1]), or one per block ([N/128, K/128])."""
    part = part.float()
    if quant.weight_block is not None:
        if part.dim() != 2:
            raise ValueError(f"{what}: expected 128 x 128 block scales, got {tuple(part.shape)}")
        copy_part(scale, part, place.in_blocks(what), what)
        return
    if part.numel() == 1:
        scale.narrow(0, place.dst_row, place.rows).fill_(part.item())
        return
    copy_part(scale, part.reshape(-1), place, what)


def dequantized(
    weight: torch.Tensor, scale: torch.Tensor, quant: QuantConfig, dtype: torch.dtype
) -> torch.Tensor:
    """The values an FP8 weight stands for, in `dtype`."""
    return dequantize_weight(weight, scale, quant.weight_block, dtype)


def empty_fp8(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, dtype=FP8_DTYPE)
