"""Scatter a step's new K/V rows into the paged KV pool (an FP8 pool: divided by each KV head's
scale and rounded to e4m3, as `minisgl.kernels.fp8.quantize_kv`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.attention.common import quantize_fp8, store_args, v_row_ptrs
from minisgl.kernels.common import is_interpreted, pdl_args, pdl_prologue


@triton.jit
def _store_kv_kernel(
    k_cache_ptr, v_cache_ptr, loc_ptr, k_ptr, v_ptr,
    k_scale_ptr,  # [NUM_HEADS] fp32 (KV_FP8)
    v_scale_ptr,
    k_shift_ptr,  # [NUM_HEADS, HEAD_DIM] fp32 (KV_FP8)
    stride_ck, stride_ckh, stride_cv, stride_cvh, stride_k, stride_kh, stride_v, stride_vh,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, KV_FP8: tl.constexpr,
    EMULATE_FP8: tl.constexpr,
    PAGE_SIZE: tl.constexpr,  # of an FP8 V cache, whose pages are [NUM_HEADS, HEAD_DIM, PAGE_SIZE]
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    t = tl.program_id(0)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < NUM_HEADS)[:, None]
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64 * stride_k + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t64 * stride_v + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if KV_FP8:
        ks = tl.load(k_scale_ptr + offs_h, mask=offs_h < NUM_HEADS, other=1.0)
        vs = tl.load(v_scale_ptr + offs_h, mask=offs_h < NUM_HEADS, other=1.0)
        k_shift = tl.load(k_shift_ptr + offs_h[:, None] * HEAD_DIM + offs_d[None, :], mask=mask)
        k = quantize_fp8(k, ks, k_shift, EMULATE_FP8)
        v = quantize_fp8(v, vs, 0.0, EMULATE_FP8)
    k_dst = k_cache_ptr + slot * stride_ck + offs_h[:, None] * stride_ckh + offs_d[None, :]
    v_dst = v_row_ptrs(v_cache_ptr, slot, offs_h, offs_d, stride_cv, stride_cvh, PAGE_SIZE, KV_FP8)
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # the same; FP8: [pages, num_kv_heads, head_dim, page_size]
    loc: torch.Tensor,  # [T] int64, destination slot of every token
    k: torch.Tensor,  # [T, num_kv_heads, head_dim], may be a strided view (e.g. of a fused qkv)
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # FP8 cache: [num_kv_heads] fp32 each
    k_shift: torch.Tensor | None = None,  # FP8 cache: [num_kv_heads, head_dim] fp32 (else 0)
) -> None:
    """`k_cache[loc] = k; v_cache[loc] = v` in one launch (converting to the cache dtype; into an
    FP8 cache as (k - k_shift) / k_scale and v / v_scale per KV head)."""
    num_tokens, num_heads, head_dim = k.shape
    assert v.shape == k.shape and loc.shape == (num_tokens,)
    assert k_cache.shape[1:] == (num_heads, head_dim)
    for t in (k_cache, v_cache, k, v):
        assert t.stride(-1) == 1, "head_dim must be contiguous"
    if head_dim & (head_dim - 1):
        raise ValueError(f"store_kv needs a power-of-two head_dim, got {head_dim}")
    page_size, fp8, k_scale, v_scale, shift = store_args(k_cache, v_cache, scales, k_shift, k)
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k_cache, v_cache, loc, k, v, k_scale, v_scale, shift, k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_HEADS=num_heads, BLOCK_H=triton.next_power_of_2(num_heads), HEAD_DIM=head_dim,
        KV_FP8=fp8, EMULATE_FP8=fp8 and is_interpreted(_store_kv_kernel), PAGE_SIZE=page_size,
        num_warps=4 if num_heads * head_dim >= 1024 else 1, **pdl_args(k.device),
    )  # fmt: skip
