"""A GEMM whose every output row sums in one order whatever the row count (`--deterministic`).

cuBLAS picks its kernel, tiles and K splits by the shape, so a token's projections change with
the batch around it. Here one tiling serves every call: BLOCK_M x BLOCK_N tiles, K in BLOCK_K
steps in order, cut into a number of splits fixed by the weight's shape alone (enough programs
to fill the GPU at one row tile, for decode steps), whose fp32 partials a second launch adds in
split order. No atomics: a row's bits depend only on its own values and the weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minisgl.kernels.common import dot, dot_flags, round_bf16


@dataclass(frozen=True)
class InvariantGemmConfig:
    """The one tiling (changing it changes every result, never their invariance)."""

    # 128 rows: a 256-row decode step reads each weight tile into two programs (cuBLAS: one
    # or two), and a one-row step's wasted MMA work (128 flops a weight byte) stays under the
    # H100's ~295 flops per byte of bandwidth. Untuned: sweep it on the target GPU.
    block_m: int = 128
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    programs: int = 264  # splits aim at this many programs for one row tile (2 per H100 SM)
    # BLOCK_K steps per split at least: K >= 1024 per split keeps the fp32 partials of a
    # 256-row step under half the weight's bytes.
    min_split_blocks: int = 16


def num_splits(n: int, k: int, cfg: InvariantGemmConfig) -> int:
    """K splits of an [N, K] weight: a function of the shape alone."""
    want = cfg.programs // triton.cdiv(n, cfg.block_n)
    return max(1, min(want, k // (cfg.block_k * cfg.min_split_blocks)))


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    out_ptr,  # [M, N] (SPLITS == 1) or the fp32 partials [SPLITS, M, N]
    M, N, K, split_len, stride_xm, stride_wn, stride_wk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLITS: tl.constexpr, IEEE: tl.constexpr, EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    # Row tiles vary fastest: the programs that read one weight tile run together (L2 hits).
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(2) * split_len
    k_end = tl.minimum(k_start + split_len, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            x_ptr + rm[:, None] * stride_xm + kk[None, :],
            mask=(rm[:, None] < M) & (kk[None, :] < k_end),
            other=0.0,
        )
        b = tl.load(
            w_ptr + kk[:, None] * stride_wk + rn[None, :] * stride_wn,
            mask=(kk[:, None] < k_end) & (rn[None, :] < N),
            other=0.0,
        )
        acc += dot(a, b, IEEE, EMULATE_BF16)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLITS == 1:
        if EMULATE_BF16:
            acc = round_bf16(acc)
        dst = out_ptr + rm[:, None] * N + rn[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        dst = out_ptr + (tl.program_id(2) * M + rm[:, None]) * N + rn[None, :]
        tl.store(dst, acc, mask=mask)


@triton.jit
def _sum_splits_kernel(
    part_ptr, y_ptr, numel, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    """y = the partials' sum, split 0 first."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in range(1, SPLITS):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    if EMULATE_BF16:
        acc = round_bf16(acc)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def invariant_matmul(
    x: torch.Tensor,  # [M, K], rows contiguous
    weight: torch.Tensor,  # [N, K]
    config: InvariantGemmConfig | None = None,
) -> torch.Tensor:  # [M, N], x's dtype
    """x W^T with each row's sums fixed by the weight's shape, never by M. No host sync."""
    cfg = config or InvariantGemmConfig()
    (m, k), n = x.shape, weight.shape[0]
    assert weight.shape[1] == k and x.stride(1) == 1
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    splits = num_splits(n, k, cfg)
    split_len = triton.cdiv(triton.cdiv(k, splits), cfg.block_k) * cfg.block_k
    out = y if splits == 1 else x.new_empty(splits, m, n, dtype=torch.float32)
    ieee, emulate = dot_flags(x.dtype, _gemm_kernel)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)
    _gemm_kernel[grid](
        x, weight, out, m, n, k, split_len, x.stride(0), weight.stride(0), weight.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLITS=splits,
        IEEE=ieee, EMULATE_BF16=emulate, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            out, y, m * n, SPLITS=splits, BLOCK=block, EMULATE_BF16=emulate
        )
    return y
