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
def block_done(num_padded_ptr, BLOCK_M: tl.constexpr):
    """(pid_m, pid_n, whether block pid_m lies past the padded rows in use: nothing to do)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    return pid_m, pid_n, pid_m * BLOCK_M >= tl.load(num_padded_ptr)


@triton.jit
def sorted_block(
    sorted_ids_ptr, block_expert_ptr, pid_m, pid_n, numel, n_cols, TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Program (pid_m, pid_n) of a blocked MoE grouped GEMM: block pid_m of `routing.moe_align`'s
    sorted (token, k) pairs x columns [pid_n * BLOCK_N, +BLOCK_N) of `n_cols`. Returns (its rows
    in the sorted buffers [BLOCK_M], their pair ids, which of them are real pairs (not padding),
    the block's expert as int64, the pairs' tokens as int64 (TOP_K per token), the output
    columns [BLOCK_N], the K step's offsets [BLOCK_K], which columns are below n_cols)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + rows)
    valid = pair < numel
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    token = (pair // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, pair, valid, expert, token, offs_n, tl.arange(0, BLOCK_K), offs_n < n_cols
