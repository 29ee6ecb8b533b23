"""FP8 (e4m3) numerics in plain torch (any device, no Triton): the KV cache's per-head scales,
weight quantization per output channel or per 128 x 128 block, and the dequantizations the
reference paths use. The Triton kernels implement the same roundings.

e4m3 (`torch.float8_e4m3fn`) keeps 3 mantissa bits: a value in its normal range (2^-6 .. 448)
is rounded with a relative error of at most 2^-4; there is no infinity, so values are clamped to
+-448 before the cast (a cast of a larger value would give NaN).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Relative rounding error of one e4m3 rounding (half a unit in the last of 3 mantissa bits).
FP8_REL_ERR = 2.0**-4
# A weight block of the block-scaled checkpoints (DeepSeek, Qwen3-*-FP8): 128 x 128.
BLOCK = 128


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """fp32 values already divided by their scale -> e4m3, saturating at +-448."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


# ---- KV cache: one scale per (layer, KV head) ---------------------------------------------------


def quantize_kv(
    x: torch.Tensor,  # [T, Hkv, D]
    scale: torch.Tensor,  # [Hkv] fp32
    shift: torch.Tensor | None = None,  # [Hkv, D] fp32, subtracted first (keys)
) -> torch.Tensor:  # [T, Hkv, D] e4m3
    xf = x.float() if shift is None else x.float() - shift
    return to_fp8(xf / scale[:, None])


# ---- an FP8 pool's V: each page stored [Hkv, D, page_size] -------------------------------------
# The P V product wants each channel's keys side by side. 16-bit V gets there through a
# transposing shared-memory load; e4m3 has none, so an FP8 pool keeps its V transposed within
# each page: a [pages, Hkv, D, page_size] tensor over the memory of [slots, Hkv, D]. K keeps the
# row layout (q K^T wants a key's channels together).


def v_pages(v: torch.Tensor, page_size: int) -> torch.Tensor:
    """An FP8 pool layer's V memory ([slots, Hkv, D], contiguous) as its [pages, Hkv, D,
    page_size] layout."""
    slots, hkv, d = v.shape
    assert v.is_contiguous() and slots % page_size == 0
    return v.view(slots // page_size, hkv, d, page_size)


def v_rows(v: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows [len(slots), Hkv, D] of a V cache at token `slots`: [slots, Hkv, D] (16-bit pools) or
    [pages, Hkv, D, page_size] (FP8 pools)."""
    if v.dim() == 3:
        return v[slots]
    ps = v.shape[3]
    return v[slots // ps, :, :, slots % ps]


def store_v_rows(v: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """`v_rows(v, slots) = rows` for an FP8 pool's V ([pages, Hkv, D, page_size]; rows e4m3),
    as bytes (the CPU has no e4m3 index_put)."""
    assert v.dim() == 4 and is_fp8(v.dtype) and is_fp8(rows.dtype)
    ps = v.shape[3]
    v.view(torch.uint8)[slots // ps, :, :, slots % ps] = rows.view(torch.uint8)


def dequantize_kv(
    x: torch.Tensor,  # [..., Hkv, D] e4m3
    scale: torch.Tensor,  # [Hkv] fp32
    dtype: torch.dtype,
) -> torch.Tensor:  # [..., Hkv, D] in `dtype`
    return (x.float() * scale[:, None]).to(dtype)


def kv_scale_from_amax(amax: torch.Tensor, headroom: float = 2.0) -> torch.Tensor:
    """Scales that map `headroom` x the observed max |value| to 448. e4m3 spans ~15 binades of
    normal numbers with the same relative precision in each, so one binade of headroom for
    values the calibration text did not reach costs nothing measurable; all-zero heads get 1."""
    scale = amax.float() * headroom / FP8_MAX
    return torch.where(scale > 0, scale, torch.ones_like(scale))


# ---- weights ----------------------------------------------------------------------------------


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], fp32 scales [N]): one scale per output channel (row)."""
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return to_fp8(wf / scale[:, None]), scale


def quantize_blocks(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (e4m3 [..., N, K], fp32 scales [..., ceil(N/b), ceil(K/b)]): one scale per
    b x b block (the last blocks of a ragged edge are smaller)."""
    n, k = w.shape[-2:]
    nb, kb = math.ceil(n / block), math.ceil(k / block)
    padded = w.float().new_zeros(*w.shape[:-2], nb * block, kb * block)
    padded[..., :n, :k] = w.float()
    tiles = padded.unflatten(-2, (nb, block)).unflatten(-1, (kb, block))  # [..., nb, b, kb, b]
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = to_fp8(padded / expand_blocks(scale, nb * block, kb * block, block))
    return q[..., :n, :k].contiguous(), scale


def expand_blocks(scale: torch.Tensor, n: int, k: int, block: int = BLOCK) -> torch.Tensor:
    """Block scales [..., nb, kb] -> one per element [..., n, k]."""
    full = scale.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return full[..., :n, :k]


def dequantize_weight(
    w: torch.Tensor,  # [..., N, K] e4m3
    scale: torch.Tensor,  # [..., N] per row, or [..., ceil(N/b), ceil(K/b)] per block
    block: int | None,  # None: per row
    dtype: torch.dtype,
) -> torch.Tensor:  # [..., N, K] in `dtype`
    n, k = w.shape[-2:]
    full = scale[..., None] if block is None else expand_blocks(scale, n, k, block)
    return (w.float() * full).to(dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], fp32 scales [M, 1]): dynamic, one scale per token."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    scale = amax / FP8_MAX
    return to_fp8(xf / scale), scale


def round_trip_activations(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """x [..., K] as the FP8 GEMMs see it: quantized per token (and per `group` columns), then
    multiplied back, in x's dtype. The reference path's copy of the tensor-core GEMMs' input."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    cols = k if group is None else group
    parts = []
    for start in range(0, k, cols):
        q, s = quantize_activations(rows[:, start : start + cols])
        parts.append(q.float() * s)
    return torch.cat(parts, dim=1).to(x.dtype).reshape(x.shape)


class ExpertScales(NamedTuple):
    """The fp32 scales of FP8 (e4m3) expert stacks: one per output row, or per 128 x 128 block."""

    w13: torch.Tensor  # [E, 2I] per row, or [E, cdiv(2I, 128), cdiv(H, 128)]
    w2: torch.Tensor  # [E, H] per row, or [E, cdiv(H, 128), cdiv(I, 128)]


def weight_scale_kind(w: torch.Tensor, scale: torch.Tensor | None) -> int:
    """The kernels' W_SCALE for a weight (or expert stack) `w` [..., N, K]: 0 for 16/32-bit
    weights, 1 for e4m3 with a scale per row ([..., N]), 2 per 128 x 128 block ([...,
    cdiv(N, 128), cdiv(K, 128)]); fp32 scales, last dim contiguous."""
    assert is_fp8(w.dtype) == (scale is not None), "e4m3 weights need their scales (and only they)"
    if scale is None:
        return 0
    assert scale.dtype == torch.float32 and scale.stride(-1) == 1
    *lead, n, k = w.shape
    if scale.dim() == w.dim() - 1:
        assert scale.shape == (*lead, n)
        return 1
    assert scale.shape == (*lead, -(-n // BLOCK), -(-k // BLOCK))
    return 2


def expert_scale_args(
    w: torch.Tensor, scale: torch.Tensor | None
) -> tuple[int, torch.Tensor, int, int]:
    """(W_SCALE, pointer, stride per expert, stride per block row) of an expert stack's scales
    for the MoE kernels; the stack itself (never read) when there are none."""
    kind = weight_scale_kind(w, scale)
    if scale is None:
        return 0, w, 0, 0
    return kind, scale, scale.stride(0), scale.stride(1) if kind == 2 else 0
