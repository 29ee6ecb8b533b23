"""Paged extend (prefill) attention: new tokens attend to their cached prefix and causally to
each other.

The new tokens' K/V are already in the pool, so every key is read through the block table.
Grid: (query blocks of BLOCK_M rows, query heads, requests). A program's keys split into blocks
that lie wholly before its first query (no mask needed) and the diagonal blocks (causal mask).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minisgl.kernels.attention.common import (
    attend_keys,
    check_tile_sizes,
    load_q,
    normalize,
    paged_launch,
    softmax_init,
)
from minisgl.kernels.common import pdl_prologue, round_bf16


@dataclass(frozen=True)
class ExtendConfig:
    """Tuning knobs of `extend_attention` (sweep them on the target GPU)."""

    # Best of the H200 sweep (W3 in docs/performance.md): 0.43 of the bf16 matmul rate.
    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self) -> None:
        check_tile_sizes(self, "block_m", "block_n")


def default_extend_config(head_dim: int, elem_size: int = 2) -> ExtendConfig:
    # The tuned tiles need ~224 KiB of shared memory at head_dim 128 in 16-bit types; wider
    # heads or fp32 inputs get tiles that fit the 227 KiB an H100/H200 block may use.
    if head_dim > 128:
        return ExtendConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)
    if head_dim * elem_size > 256:
        return ExtendConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
    return ExtendConfig()


@triton.jit(do_not_specialize=["stride_bt"])  # the block-table width changes every step
def _extend_kernel(
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [slots, Hkv, D]
    v_ptr,  # [slots, Hkv, D]; FP8: [pages, Hkv, D, PAGE_SIZE] (`KVPool`)
    block_table_ptr,  # [B, P] int32
    seq_lens_ptr,  # [B] int32
    extend_lens_ptr,  # [B] int32
    cu_extend_ptr,  # [B+1] int32
    o_ptr,  # [T, Hq, D]
    k_scale_ptr,  # [Hkv] fp32 (KV_FP8)
    v_scale_ptr,  # [Hkv] fp32 (KV_FP8)
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_bt, stride_ot,
    stride_oh, scale_log2, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, KV_FP8: tl.constexpr, IEEE: tl.constexpr,
    EMULATE_BF16: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    # The last query blocks see the most keys: launch them first so the tail is short.
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    kv_head = head // GROUP

    extend_len = tl.load(extend_lens_ptr + b)
    seq_len = tl.load(seq_lens_ptr + b)
    first_row = tl.load(cu_extend_ptr + b).to(tl.int64)
    prefix_len = seq_len - extend_len
    m_start = m_block * BLOCK_M
    active = m_start < extend_len  # blocks past a short request's end do nothing

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_m = offs_m < extend_len
    q_pos = prefix_len + offs_m  # [BLOCK_M]
    q_rows = first_row + offs_m
    q_ptrs = q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q, qk_scale = load_q(q_ptrs, mask_m, scale_log2, k_scale_ptr, kv_head, KV_FP8)  # [BLOCK_M, D]

    table_row = block_table_ptr + b * stride_bt
    k_base = k_ptr + kv_head * stride_kh + offs_d[None, :]
    v_base = v_ptr + kv_head * stride_vh
    m_i, l_i, acc = softmax_init(BLOCK_M, HEAD_DIM)

    # Keys before this block's first query: visible to every row, no mask.
    full_end = tl.where(active, (prefix_len + m_start) // BLOCK_N * BLOCK_N, 0)
    m_i, l_i, acc = attend_keys(
        q, q_pos, table_row, k_base, v_base, stride_kt, stride_vt, m_i, l_i, acc, 0, full_end,
        qk_scale, False, BLOCK_N, PAGE_SIZE, KV_FP8, IEEE, EMULATE_BF16, MASKED=False,
    )  # fmt: skip
    # Diagonal blocks: key k is visible to query row r iff pos(k) <= pos(r).
    causal_end = tl.where(active, tl.minimum(seq_len, prefix_len + m_start + BLOCK_M), 0)
    m_i, l_i, acc = attend_keys(
        q, q_pos, table_row, k_base, v_base, stride_kt, stride_vt, m_i, l_i, acc, full_end,
        causal_end, qk_scale, True, BLOCK_N, PAGE_SIZE, KV_FP8, IEEE, EMULATE_BF16,
    )  # fmt: skip

    out, _ = normalize(acc, l_i, v_scale_ptr, kv_head, KV_FP8)
    if EMULATE_BF16:
        out = round_bf16(out)
    o_dst = o_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_dst, out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None])


def extend_attention(
    q: torch.Tensor,  # [T, Hq, D], request i's rows are cu_extend[i] : cu_extend[i+1]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D], already holding the new tokens' K
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    block_table: torch.Tensor,  # [B, P] int32 page ids
    seq_lens: torch.Tensor,  # [B] int32, context length after this step
    extend_lens: torch.Tensor,  # [B] int32, new tokens of each request
    cu_extend: torch.Tensor,  # [B+1] int32, prefix sums of extend_lens
    page_size: int,
    sm_scale: float,
    max_extend_len: int,  # host int >= max(extend_lens), sizes the grid
    *,
    config: ExtendConfig | None = None,
    out: torch.Tensor | None = None,  # [T, Hq, D], written in place if given
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # FP8 cache: [Hkv] fp32 each
) -> torch.Tensor:  # [T, Hq, D], dtype of q
    """Causal attention of new tokens at positions `seq_len - extend_len .. seq_len - 1` over
    their request's paged context. No host sync. An FP8 (e4m3) cache comes with its per-KV-head
    scales."""
    num_tokens, num_q_heads, head_dim = q.shape
    batch = seq_lens.shape[0]
    out, (k_scale, v_scale), strides, flags = paged_launch(_extend_kernel, q, k_cache, v_cache,
        block_table, seq_lens, kv_scales, out, cu_extend, extend_lens)  # fmt: skip
    cfg = config or default_extend_config(head_dim, q.element_size())
    if num_tokens == 0 or batch == 0 or max_extend_len == 0:
        return out
    grid = (triton.cdiv(max_extend_len, cfg.block_m), num_q_heads, batch)
    _extend_kernel[grid](
        q, k_cache, v_cache, block_table, seq_lens, extend_lens, cu_extend, out, k_scale, v_scale,
        *strides, sm_scale * math.log2(math.e), GROUP=num_q_heads // k_cache.shape[1],
        HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PAGE_SIZE=page_size,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags,
    )  # fmt: skip
    return out
