"""Linear layers of decode batches (a few to a few hundred rows) on CUDA, with the work around
them fused in: y[M, N] = epilogue(W[N, K] @ prologue(x[M, K])). The batch version of
`minisgl.kernels.gemv`, with the same prologues and epilogues:

- RMSNorm of each row of x (`norm_weight`): each program walks all of K for its rows anyway, so
  it sums x^2 on the way and scales its products by each row's rstd at the end (the norm
  weight is applied before the product; no separate norm kernel);
- or SiLU-and-multiply (`act`): x is [M, 2K], gate then up (a down projection straight from
  the gate/up output);
- bias and residual in the epilogue (`residual`: y = W x + r, the next residual);
- each program loads its first weight tile before waiting on the previous kernel (programmatic
  dependent launch): weights do not depend on it.

Why: in a decode step of 32-256 rows the four projections of a small model are latency-bound
cuBLAS kernels (~4x their bytes at W1's batch 214 on an H200), with a norm kernel before two of
them and a SiLU kernel between the others. An experiment (`MINISGL_ROWS_GEMM_MAX_ROWS`), not
measured yet: `scripts/rows_gemm_probe.py` compares it with cuBLAS at W1's shapes.

Numerics: fp32 accumulation; the prologue's result is rounded to the model dtype for the
tensor-core product (as the torch layers round their normalised or activated x), but the norm
weight is applied before the rstd, so results agree with the layers within bf16 rounding, not
bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minisgl.kernels.common import dot, dot_flags, pdl_args, pdl_prologue, round_bf16
from minisgl.kernels.gemv import fused_linear_supported


@dataclass(frozen=True)
class RowsGemmConfig:
    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    # >1: K in that many slices, one program each, fp32 partial sums reduced by a second
    # kernel (more programs for a small N; the partials cost a write and a read)
    split_k: int = 1


def default_rows_config(m: int, n: int, k: int) -> RowsGemmConfig:
    """A starting point, not measured: tiles of up to 64 rows, narrower columns when N is small
    so that the grid still covers the SMs."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 32 if n <= 2048 else 64
    return RowsGemmConfig(block_m, block_n, 64, 4, 3)


@triton.jit
def _x_tile(
    x_ptrs, g_ptr, offs_k, k0, K, mask_m, ss, NORM: tl.constexpr, ACT: tl.constexpr,
    EMULATE_BF16: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """Columns k0 + offs_k of the prologue's output for the tile's rows, in the model dtype (and
    the running sum of squares for NORM)."""
    kk = k0 + offs_k
    mask = mask_m[:, None] & (kk < K)[None, :]
    x = tl.load(x_ptrs + k0, mask=mask, other=0.0).to(tl.float32)
    if ACT:
        up = tl.load(x_ptrs + K + k0, mask=mask, other=0.0).to(tl.float32)
        x = x / (1.0 + tl.exp(-x)) * up
    if NORM:
        ss += tl.sum(x * x, 1)
        x = x * tl.load(g_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
    if EMULATE_BF16:
        x = round_bf16(x)
    return x.to(DTYPE), ss


@triton.jit
def _epilogue(
    acc, ss, offs_m, offs_n, mask_m, mask_n, y_ptr, b_ptr, r_ptr, N, K, eps,
    NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
):  # fmt: skip
    """acc [BLOCK_M, BLOCK_N], the full-K product: the norm's rstd, bias, residual; stored."""
    if NORM:
        acc = acc * (1.0 / tl.sqrt(ss / K + eps))[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    out = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    if HAS_RES:
        acc += tl.load(r_ptr + out, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rows_gemm_kernel(
    x_ptr,  # [M, K] rows with a unit column stride ([M, 2K] if ACT)
    w_ptr,  # [N, K]
    y_ptr,  # [M, N] contiguous
    b_ptr,  # [N] (HAS_BIAS)
    r_ptr,  # [M, N] residual (HAS_RES), contiguous
    g_ptr,  # [K] RMSNorm weight (NORM)
    part_ptr,  # [SPLIT_K, M, N] fp32 partial products (SPLIT_K > 1)
    ss_ptr,  # [SPLIT_K, M] fp32 partial sums of squares (SPLIT_K > 1 and NORM)
    M,
    N,
    K,
    K_SPLIT,  # columns per K slice: a multiple of BLOCK_K (K rounded up without a split)
    stride_xm,
    stride_wn,
    stride_wk,
    eps,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    NORM: tl.constexpr,
    ACT: tl.constexpr,
    IEEE: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    # K slice of this program: [k_lo, k_lo + K_SPLIT); the last may run past K (masked).
    k_lo = tl.program_id(2) * K_SPLIT
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_m = offs_m < M
    # [BLOCK_K, BLOCK_N] tiles of W^T: row n of W is column n of the tile
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    dtype = w_ptr.dtype.element_ty
    # The first weight tile does not depend on the previous kernel: read it before the wait.
    w = tl.load(
        w_ptrs + k_lo * stride_wk, mask=mask_n[None, :] & (k_lo + offs_k < K)[:, None], other=0.0
    )
    pdl_prologue(PDL)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    x, ss = _x_tile(x_ptrs, g_ptr, offs_k, k_lo, K, mask_m, ss, NORM, ACT, EMULATE_BF16, dtype)
    acc = dot(x, w, IEEE, EMULATE_BF16)
    # Pipelined (cp.async stages) on sm_90 when K_SPLIT is a multiple of 16, as the launcher
    # specialises it: the loads' addresses are then known to be aligned.
    for i in tl.range(1, K_SPLIT // BLOCK_K, num_stages=NUM_STAGES):
        k0 = k_lo + i * BLOCK_K
        kk = k0 + offs_k
        w = tl.load(w_ptrs + k0 * stride_wk, mask=mask_n[None, :] & (kk < K)[:, None], other=0.0)
        x, ss = _x_tile(x_ptrs, g_ptr, offs_k, k0, K, mask_m, ss, NORM, ACT, EMULATE_BF16, dtype)
        acc += dot(x, w, IEEE, EMULATE_BF16)
    if SPLIT_K == 1:
        _epilogue(acc, ss, offs_m, offs_n, mask_m, mask_n, y_ptr, b_ptr, r_ptr, N, K, eps,
                  NORM, HAS_BIAS, HAS_RES)  # fmt: skip
    else:
        slice_ = tl.program_id(2).to(tl.int64)
        out = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(part_ptr + slice_ * M * N + out, acc, mask=mask_m[:, None] & mask_n[None, :])
        if NORM and pid_n == 0:  # every column tile sums the same rows: one stores them
            tl.store(ss_ptr + slice_ * M + offs_m, ss, mask=mask_m)


@triton.jit
def _split_k_reduce_kernel(
    part_ptr, ss_ptr, y_ptr, b_ptr, r_ptr, M, N, K, eps,
    NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The K slices' partial products summed, then the epilogue."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    mask = mask_m[:, None] & mask_n[None, :]
    out = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    pdl_prologue(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * M * N + out, mask=mask, other=0.0)
        if NORM:
            ss += tl.load(ss_ptr + s * M + offs_m, mask=mask_m, other=0.0)
    _epilogue(acc, ss, offs_m, offs_n, mask_m, mask_n, y_ptr, b_ptr, r_ptr, N, K, eps,
              NORM, HAS_BIAS, HAS_RES)  # fmt: skip


def rows_gemm(
    x: torch.Tensor,  # [M, K] ([M, 2K] gate then up with act)
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    residual: torch.Tensor | None = None,  # [M, N] added to the result
    norm_weight: torch.Tensor | None = None,  # [K]: rows of x are RMS-normalised and scaled first
    eps: float = 1e-6,
    act: bool = False,  # x is gate then up: the product uses silu(gate) * up
    config: RowsGemmConfig | None = None,
) -> torch.Tensor:  # [M, N], dtype of x
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    assert fused_linear_supported(x, weight) and x.shape[1] == (2 * k if act else k)
    assert not (act and norm_weight is not None)
    assert bias is None or bias.shape == (n,)
    assert residual is None or (residual.shape == (m, n) and residual.is_contiguous())
    assert norm_weight is None or norm_weight.shape == (k,)
    cfg = config or default_rows_config(m, n, k)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    ieee, emulate_bf16 = dot_flags(x.dtype, _rows_gemm_kernel)
    k_tiles = triton.cdiv(k, cfg.block_k)
    split = max(1, min(cfg.split_k, k_tiles))
    k_split = triton.cdiv(k_tiles, split) * cfg.block_k
    split = triton.cdiv(k, k_split)  # no empty slice
    b, r = bias if bias is not None else y, residual if residual is not None else y
    norm = norm_weight is not None
    part = ss = y
    if split > 1:
        part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        ss = torch.empty(split, m, dtype=torch.float32, device=x.device) if norm else part
    pdl = pdl_args(x.device)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), split)
    _rows_gemm_kernel[grid](
        x, weight, y, b, r, norm_weight if norm else x, part, ss, m, n, k, k_split, x.stride(0),
        weight.stride(0), weight.stride(1), eps, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, NORM=norm, ACT=act, IEEE=ieee, EMULATE_BF16=emulate_bf16,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        NUM_STAGES=cfg.num_stages, SPLIT_K=split, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl,
    )  # fmt: skip
    if split > 1:
        block_m, block_n = 16, 128
        _split_k_reduce_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
            part, ss, y, b, r, m, n, k, eps, NORM=norm, HAS_BIAS=bias is not None,
            HAS_RES=residual is not None, SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=4, **pdl,
        )  # fmt: skip
    return y
