"""Triton building blocks shared by the blocked MoE grouped GEMMs (weight-only and W8A8)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_block_scales(s_ptr, rows, block_col, stride_sn, mask):
    """Block-scaled FP8 weights ([cdiv(N, 128), cdiv(K, 128)] fp32 scales, rows `stride_sn`
    apart): the scale of each of `rows`' 128-row block at block column `block_col`; 0 where
    `mask` is off."""
    return tl.load(s_ptr + (rows // 128) * stride_sn + block_col, mask=mask, other=0.0)


@triton.jit
def sorted_block(sorted_ids_ptr, block_expert_ptr, pid_m, numel, BLOCK_M: tl.constexpr):
    """Block `pid_m` of a blocked MoE grouped GEMM (`routing.moe_align`'s sorted
    (token, k) pairs): (its rows in the sorted buffers [BLOCK_M], their pair ids, which of them
    are real pairs (not padding), and the block's expert as int64)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + rows)
    return rows, pair, pair < numel, tl.load(block_expert_ptr + pid_m).to(tl.int64)
