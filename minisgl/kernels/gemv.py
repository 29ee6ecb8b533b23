"""One-row linear layers for batch-1 decode on CUDA, with the work around them fused in:
y[N] = epilogue(W[N, K] @ prologue(x[K])).

At batch 1 a linear layer is a pure read of its weight, and a decoder layer is four such reads
with a handful of tiny kernels between them (norm, residual add, SiLU). cuBLAS reads the larger
matrices near the copy bandwidth but every kernel boundary costs a launch and a ramp, and
cuBLAS adds split-K reduce kernels of its own. Here:

- the prologue can apply RMSNorm to x (`norm_weight`): each program walks all of K anyway, so it
  sums x^2 on the way and scales its dot products by the rstd at the end (no separate norm
  kernel, no normalised copy of x);
- or the prologue can be SiLU-and-multiply (`act`): x is [2K], gate then up, and the product
  uses silu(x[:K]) * x[K:] (a down projection straight from the gate/up output);
- the epilogue can add a bias and a residual (`residual`: y = W x + r, the next residual);
- each program loads its first weight tile *before* waiting on the previous kernel (weights do
  not depend on it), under programmatic dependent launch: the next GEMV's programs are already
  streaming their weights while the previous kernel drains;
- weights and x are double-buffered in registers, so two tiles per program are in flight.

Each program owns BLOCK_N rows and keeps a [BLOCK_N, BLOCK_K] fp32 partial sum, reduced once at
the end. Numerics: fp32 products and sums; the normalised x is not rounded to the model dtype
before the product (the torch layers round it), so results agree with them within bf16 rounding,
not bit for bit.

FP8 weights (`weight_scale`): e4m3 rows widened in registers, with one scale per output row
(applied to the row's sum at the end) or one per 128 x 128 block (folded into x, 128 columns at
a time; a program's BLOCK_N rows then lie in one block row). Half the bytes of bf16 for the same
work: the weight-only path of an FP8 linear layer at small batch.

Several rows of x (small batches) run as that many programs per BLOCK_N weight rows, launched
next to each other, so all but the first read the weight tile from L2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minisgl.kernels.common import pdl_args, pdl_prologue


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 16
    block_k: int = 512
    num_warps: int = 4
    preload: bool = True  # first weight tile loaded before the PDL wait


# (N, K, act) -> config measured best on an H200 (bf16, `python -m minisgl.benchmark.gemv`, the
# best of 17 per shape); the default below for the rest (within 1% of the best for the
# Llama-3-8B qkv and o_proj).
TUNED: dict[tuple[int, int, bool], GemvConfig] = {
    (28672, 4096, False): GemvConfig(16, 256, 4),  # Llama-3-8B gate/up: 56.3 us
    (4096, 14336, True): GemvConfig(8, 512, 8),  # Llama-3-8B down after SiLU: 28.7 us
    (128256, 4096, False): GemvConfig(32, 256, 4),  # Llama-3 LM head: 238.4 us
    (5120, 2048, False): GemvConfig(4, 256, 4),  # Qwen3-30B-A3B qkv: 7.07 us
    (2048, 4096, False): GemvConfig(4, 1024, 8),  # Qwen3-30B-A3B o_proj: 5.28 us
    (128, 2048, False): GemvConfig(2, 2048, 8),  # Qwen3-30B-A3B router (one-row MoE sweep)
}


# The same for FP8 (e4m3) weights, from `python -m minisgl.benchmark.gemv --fp8` on the H200
# (docs/benchmarks.md); other shapes take the bf16 table's tiles.
TUNED_FP8: dict[tuple[int, int, bool], GemvConfig] = {
    (6144, 4096, False): GemvConfig(16, 256, 8),
    (4096, 4096, False): GemvConfig(8, 512, 8),
    (28672, 4096, False): GemvConfig(16, 256, 4),
    (4096, 14336, True): GemvConfig(8, 512, 8),
    (128256, 4096, False): GemvConfig(16, 256, 4),
    (5120, 2048, False): GemvConfig(8, 256, 8),
    (2048, 4096, False): GemvConfig(8, 1024, 8),
}


def default_config(n: int, k: int, act: bool = False, fp8: bool = False) -> GemvConfig:
    """The measured config for this shape, else what did well across the measured ones."""
    if fp8 and (n, k, act) in TUNED_FP8:
        return TUNED_FP8[(n, k, act)]
    return TUNED.get((n, k, act)) or GemvConfig(8, 1024 if k >= 1024 else 256, 4)


@triton.jit
def _load_x(x_ptr, offs, K, ACT: tl.constexpr):
    """x[offs] in fp32 (0 past K); with ACT, silu(x[offs]) * x[K + offs]."""
    x = tl.load(x_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)
    if ACT:
        up = tl.load(x_ptr + K + offs, mask=offs < K, other=0.0).to(tl.float32)
        x = x / (1.0 + tl.exp(-x)) * up
    return x


@triton.jit
def _block_scales(s_ptr, offs, K, W_SCALE: tl.constexpr):
    """The weight scales of columns `offs` of a program's rows (128 x 128 blocks), 1 past K."""
    if W_SCALE == 2:
        s = tl.load(s_ptr + offs // 128, mask=offs < K, other=1.0)
    else:
        s = offs
    return s


# `M` (rows of x) is specialized: at M == 1 (batch-1 decode) the row arithmetic folds away
# (the H200's W2 step took 0.4 ms longer with M a plain runtime value); other M take one or two
# more variants.
@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K], rows `stride_xm` apart ([M, 2K] if ACT)
    w_ptr,  # [N, K]
    y_ptr,  # [M, N] contiguous
    b_ptr,  # [N] (HAS_BIAS)
    r_ptr,  # [M, N] residual, contiguous (HAS_RES)
    g_ptr,  # [K] RMSNorm weight (NORM)
    s_ptr,  # W_SCALE 1: [N] fp32 per row; 2: [cdiv(N, 128), cdiv(K, 128)] fp32 per block
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_wk,
    stride_sn,
    eps,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    NORM: tl.constexpr,
    ACT: tl.constexpr,
    W_SCALE: tl.constexpr,  # 0: none, 1: per row, 2: per 128 x 128 block (FP8 weights)
    PRELOAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    # Programs of the same weight rows (one per row of x) are neighbours: one DRAM read each.
    row = tl.program_id(0) % M
    offs_n = (tl.program_id(0) // M) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk
    x_ptr += row.to(tl.int64) * stride_xm
    s_row = s_ptr + ((tl.program_id(0) // M) * BLOCK_N // 128).to(tl.int64) * stride_sn
    # The first weight tile and the norm weight do not depend on the previous kernel: with
    # PRELOAD they are read before the PDL wait, otherwise after it.
    if not PRELOAD:
        pdl_prologue(PDL)
    m0 = mask_n[:, None] & (offs_k < K)[None, :]
    w = tl.load(rows, mask=m0, other=0.0, eviction_policy="evict_first")
    if NORM:
        g = tl.load(g_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
    s = _block_scales(s_row, offs_k, K, W_SCALE)
    if PRELOAD:
        pdl_prologue(PDL)
    x = _load_x(x_ptr, offs_k, K, ACT)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # Next tiles first (masked off past K), then the products of this one.
        kn = k0 + BLOCK_K + offs_k
        mn = mask_n[:, None] & (kn < K)[None, :]
        w_next = tl.load(
            rows + (k0 + BLOCK_K) * stride_wk, mask=mn, other=0.0, eviction_policy="evict_first"
        )
        x_next = _load_x(x_ptr, kn, K, ACT)
        if W_SCALE == 2:
            s_next = _block_scales(s_row, kn, K, W_SCALE)
        if NORM:  # the norm weight is prefetched with x: no load waits inside an iteration
            g_next = tl.load(g_ptr + kn, mask=kn < K, other=0.0).to(tl.float32)
            ss += x * x
            x = x * g
            g = g_next
        if W_SCALE == 2:
            x = x * s
        acc += w.to(tl.float32) * x[None, :]
        w = w_next
        x = x_next
        if W_SCALE == 2:
            s = s_next
    y = tl.sum(acc, 1)
    if W_SCALE == 1:
        y = y * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)
    if NORM:
        y = y * (1.0 / tl.sqrt(tl.sum(ss, 0) / K + eps))
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    out = row.to(tl.int64) * N + offs_n
    if HAS_RES:
        y += tl.load(r_ptr + out, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + out, y.to(y_ptr.dtype.element_ty), mask=mask_n)


def gemv_supported(x: torch.Tensor, weight: torch.Tensor, max_rows: int = 1) -> bool:
    """At most `max_rows` rows of x, a float dtype shared with the weight or an e4m3 weight.
    (Any weight strides work; rows with a unit column stride, as on CUDA, are what the kernel is
    fast for.)"""
    return (
        x.dim() == 2
        and 1 <= x.shape[0] <= max_rows
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and weight.dtype in (x.dtype, torch.float8_e4m3fn)
        and weight.dim() == 2
        and x.stride(1) == 1
    )


def gemv(
    x: torch.Tensor,  # [M, K] ([M, 2K] gate then up with act), M small
    weight: torch.Tensor,  # [N, K], x's dtype or e4m3 (with weight_scale)
    bias: torch.Tensor | None = None,  # [N]
    residual: torch.Tensor | None = None,  # [M, N] added to the result
    norm_weight: torch.Tensor | None = None,  # [K]: x is RMS-normalised and scaled by it first
    eps: float = 1e-6,
    act: bool = False,  # x is gate then up: the product uses silu(gate) * up
    config: GemvConfig | None = None,
    weight_scale: torch.Tensor | None = None,  # e4m3 weight: [N] per row, or [N/128, K/128]
) -> torch.Tensor:  # [M, N], dtype of x
    assert gemv_supported(x, weight, max_rows=x.shape[0])
    m, n, k, w_scale = check_fused_linear(x, weight, bias, residual, norm_weight, act, weight_scale)
    cfg = config or default_config(n, k, act, fp8=w_scale != 0)
    if w_scale == 2:
        assert 128 % cfg.block_n == 0, "a program's rows must lie in one 128-row block"
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    scale = weight_scale if weight_scale is not None else y
    _gemv_kernel[(triton.cdiv(n, cfg.block_n) * m,)](
        x, weight, y, bias if bias is not None else y, residual if residual is not None else y,
        norm_weight if norm_weight is not None else x, scale, m, n, k, x.stride(0),
        weight.stride(0), weight.stride(1), scale.stride(0), eps, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, NORM=norm_weight is not None, ACT=act, W_SCALE=w_scale,
        PRELOAD=cfg.preload, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        **pdl_args(x.device),
    )  # fmt: skip
    return y


def check_fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    act: bool,
    weight_scale: torch.Tensor | None,
) -> tuple[int, int, int, int]:
    """The shapes of a fused few-row linear call (`gemv`, `minisgl.kernels.skinny.skinny`):
    (M, N, K, the W_SCALE variant)."""
    m = x.shape[0]
    n, k = weight.shape
    assert x.shape[1] == (2 * k if act else k)
    assert not (act and norm_weight is not None)
    assert bias is None or bias.shape == (n,)
    assert residual is None or (residual.shape == (m, n) and residual.is_contiguous())
    assert norm_weight is None or norm_weight.shape == (k,)
    return m, n, k, _check_weight_scale(weight, weight_scale)


def _check_weight_scale(weight: torch.Tensor, scale: torch.Tensor | None) -> int:
    """The W_SCALE variant: 0 for a 16/32-bit weight, 1 (per row) or 2 (per block) for e4m3."""
    fp8 = weight.dtype == torch.float8_e4m3fn
    assert fp8 == (scale is not None), "an e4m3 weight needs its scales (and only it)"
    if scale is None:
        return 0
    n, k = weight.shape
    assert scale.dtype == torch.float32 and scale.stride(-1) == 1
    if scale.dim() == 1:
        assert scale.shape == (n,)
        return 1
    assert scale.shape == (triton.cdiv(n, 128), triton.cdiv(k, 128))
    return 2
