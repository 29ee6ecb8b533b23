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


def default_config(n: int, k: int, act: bool = False) -> GemvConfig:
    """The measured config for this shape, else what did well across the measured ones."""
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
def _gemv_kernel(
    x_ptr,  # [K] contiguous ([2K] if ACT)
    w_ptr,  # [N, K]
    y_ptr,  # [N] contiguous
    b_ptr,  # [N] (HAS_BIAS)
    r_ptr,  # [N] residual (HAS_RES)
    g_ptr,  # [K] RMSNorm weight (NORM)
    N,
    K,
    stride_wn,
    stride_wk,
    eps,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    NORM: tl.constexpr,
    ACT: tl.constexpr,
    PRELOAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk
    # The first weight tile and the norm weight do not depend on the previous kernel: with
    # PRELOAD they are read before the PDL wait, otherwise after it.
    if not PRELOAD:
        pdl_prologue(PDL)
    m0 = mask_n[:, None] & (offs_k < K)[None, :]
    w = tl.load(rows, mask=m0, other=0.0, eviction_policy="evict_first")
    if NORM:
        g = tl.load(g_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
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
        if NORM:  # the norm weight is prefetched with x: no load waits inside an iteration
            g_next = tl.load(g_ptr + kn, mask=kn < K, other=0.0).to(tl.float32)
            ss += x * x
            x = x * g
            g = g_next
        acc += w.to(tl.float32) * x[None, :]
        w = w_next
        x = x_next
    y = tl.sum(acc, 1)
    if NORM:
        y = y * (1.0 / tl.sqrt(tl.sum(ss, 0) / K + eps))
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if HAS_RES:
        y += tl.load(r_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)


def gemv_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One row of x, a float dtype shared with the weight. (Any weight strides work; rows with
    a unit column stride, as on CUDA, are what the kernel is fast for.)"""
    return (
        x.dim() == 2
        and x.shape[0] == 1
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and x.stride(1) == 1
    )


def gemv(
    x: torch.Tensor,  # [1, K] ([1, 2K] gate then up with act)
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    residual: torch.Tensor | None = None,  # [1, N] added to the result
    norm_weight: torch.Tensor | None = None,  # [K]: x is RMS-normalised and scaled by it first
    eps: float = 1e-6,
    act: bool = False,  # x is gate then up: the product uses silu(gate) * up
    config: GemvConfig | None = None,
) -> torch.Tensor:  # [1, N], dtype of x
    n, k = weight.shape
    assert gemv_supported(x, weight) and x.shape[1] == (2 * k if act else k)
    assert not (act and norm_weight is not None)
    assert bias is None or bias.shape == (n,)
    assert residual is None or (residual.shape == (1, n) and residual.is_contiguous())
    assert norm_weight is None or norm_weight.shape == (k,)
    cfg = config or default_config(n, k, act)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, y, bias if bias is not None else y, residual if residual is not None else y,
        norm_weight if norm_weight is not None else x, n, k, weight.stride(0), weight.stride(1),
        eps, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        NORM=norm_weight is not None, ACT=act, PRELOAD=cfg.preload, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, **pdl_args(x.device),
    )  # fmt: skip
    return y
