"""Matrix-vector product for one-token decode steps on CUDA: y[1, N] = x[1, K] @ W[N, K]^T.

At batch 1 a linear layer is a pure read of its weight. On the H200 cuBLAS reads the
Llama-3-8B attention projections (N = 6144 / 4096, K = 4096) at about 75% of the copy bandwidth
and follows o_proj and down_proj with a split-K reduce kernel. Here each program owns BLOCK_N
rows of W and streams them in BLOCK_K-wide slices, multiplying by the matching slice of x and
keeping a [BLOCK_N, BLOCK_K] fp32 partial sum that is reduced once at the end: one kernel, every
byte of W read once, fp32 accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3


# (N, K) -> config, for the shapes where `scripts/gemv_tune.py` measured the GEMV faster than
# cuBLAS on an H200 (bf16); `layers.linear` takes the GEMV only for these.
TUNED: dict[tuple[int, int], GemvConfig] = {}


def tuned_config(n: int, k: int) -> GemvConfig | None:
    return TUNED.get((n, k))


@triton.jit
def _gemv_kernel(
    x_ptr,  # [K]
    w_ptr,  # [N, K], row stride stride_wn, unit column stride
    b_ptr,  # [N] or a dummy
    y_ptr,  # [N]
    N,
    K,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + offs_k
        mask_k = cols < K
        x = tl.load(x_ptr + cols, mask=mask_k, other=0.0).to(tl.float32)
        w = tl.load(rows + cols[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)


def gemv_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One row of x, a weight with contiguous rows, 16-bit floats of one dtype."""
    return (
        x.dim() == 2
        and x.shape[0] == 1
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.stride(1) == 1
        and x.stride(1) == 1
    )


def gemv(
    x: torch.Tensor,  # [1, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    config: GemvConfig | None = None,
) -> torch.Tensor:  # [1, N], dtype of x
    n, k = weight.shape
    assert gemv_supported(x, weight) and x.shape[1] == k
    cfg = config or tuned_config(n, k) or GemvConfig()
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else y, y, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y
