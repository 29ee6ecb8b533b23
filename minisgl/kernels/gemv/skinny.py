"""Skinny GEMMs: linear layers with a few rows of x (M = 1..16) on tensor cores, reading each
weight tile from DRAM once for all M rows: y[M, N] = epilogue(prologue(x)[M, K] W[N, K]^T).

The fused GEMV (`gemv.py`) costs a pass over the tile per row of x; cuBLAS at 2..16 rows (a
speculative verify step, a small decode batch) is a GEMM sized for large M. Here one program
owns BLOCK_N weight rows and all rows of x: each K step is one `tl.dot(w [BLOCK_N, BLOCK_K],
x^T [BLOCK_K, 16])` (rows past M are zeros) into a [BLOCK_N, 16] fp32 accumulator, so tiles can
be large and Triton's software pipeline keeps several in flight.

Prologue and epilogue as in the GEMV (x rounded to the operand dtype for the dot, as the torch
layers round it); e4m3 weights widened to x's dtype in registers, block scales on each
128-column step's dot. Split-K (`SkinnyConfig.split_k`) for shapes with too few tiles: the last
split of a tile to finish (a counter per tile, zeroed again by it) adds the splits' fp32
partials in a fixed order and runs the epilogue (one kernel, deterministic). A program's first
weight tile is loaded before the PDL wait and multiplied after the loop.

No host sync; the allocations are the output and the split-K scratch, of sizes fixed by the
shape: CUDA-graph capturable (run once before capturing: the split counters).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minisgl.kernels.common import dot, dot_flags, num_sms, pdl_prologue, round_bf16, split_counters
from minisgl.kernels.gemv.gemv import check_fused_linear, gemv_supported, launch_args

BLOCK_M = 16  # rows of x per program: tl.dot's smallest side
MAX_ROWS = BLOCK_M
SCALE_BLOCK = 128  # of block-scaled FP8 weights


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int = 64
    block_k: int = 128  # must be 128 with block-scaled FP8 weights (one scale per K step)
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1


# Weight formats: 16-bit, e4m3 with a scale per row, e4m3 with 128 x 128 block scales.
FORMATS = ("bf16", "row", "block")
# (N, K, act, format) -> config measured best on an H200 (`python -m minisgl.benchmark.tune
# skinny --quick`; us at M = 5, cuBLAS beside it): faster than cuBLAS on small layers, slower on
# Llama-3-8B's (down 50.8 vs 32.7); e4m3 weights ran behind the FP8 GEMV: not tabled.
TUNED: dict[tuple[int, int, bool, str], SkinnyConfig] = {
    (6144, 4096, False, "bf16"): SkinnyConfig(64, 256, 4, 3, 1),  # 8b qkv: 16.1 (15.8)
    (4096, 4096, False, "bf16"): SkinnyConfig(64, 256, 4, 3, 1),  # 8b o_proj: 12.6 (13.5)
    (28672, 4096, False, "bf16"): SkinnyConfig(64, 256, 4, 3, 1),  # 8b gate_up
    (4096, 14336, True, "bf16"): SkinnyConfig(64, 128, 4, 4, 5),  # 8b down after SiLU
    (128256, 4096, False, "bf16"): SkinnyConfig(64, 128, 4, 4, 1),  # 8b lm_head: 240 (254)
    (4096, 1024, False, "bf16"): SkinnyConfig(64, 256, 4, 3, 1),  # 0.6b qkv: 5.1 (5.2)
    (1024, 2048, False, "bf16"): SkinnyConfig(32, 128, 4, 4, 4),  # 0.6b o_proj
    (6144, 1024, False, "bf16"): SkinnyConfig(64, 256, 4, 3, 1),  # 0.6b gate_up: 5.9 (6.1)
    (1024, 3072, True, "bf16"): SkinnyConfig(64, 128, 4, 4, 6),  # 0.6b down: 6.9 (7.5)
    (151936, 1024, False, "bf16"): SkinnyConfig(32, 128, 4, 4, 1),  # 0.6b lm_head: 77 (79)
}


def default_config(
    n: int, k: int, act: bool = False, fmt: str = "bf16", sms: int = 132
) -> SkinnyConfig:
    """The measured config for this shape, else a guess (not measured): 64-row tiles (32 when
    that leaves under two tiles per SM; `sms`: an H200 has 132), split-K up to two programs per
    SM (at least 4 K steps a split), 128 columns per K step (256 for e4m3 with a scale per row:
    the same bytes), four stages in flight."""
    tuned = TUNED.get((n, k, act, fmt))
    if tuned is not None:
        return tuned
    block_n = 64 if n >= 64 * 2 * sms else 32
    tiles = triton.cdiv(n, block_n)
    block_k = 256 if fmt == "row" else 128
    split_k = max(1, min(8, triton.cdiv(2 * sms, tiles), k // (4 * block_k)))
    return SkinnyConfig(block_n, block_k, 4, 4, split_k)


@triton.jit
def _x_tile(
    x_ptr,  # [M, K] (or [M, 2K] with ACT), rows stride_xm apart
    g_ptr,  # [K] RMSNorm weight (NORM)
    offs_k,  # [BLOCK_K] columns
    offs_m,  # [BLOCK_M] rows
    M, K,
    k_end,  # columns from here on read as zeros (K, or less for an empty tile)
    stride_xm, NORM: tl.constexpr, ACT: tl.constexpr,
):  # fmt: skip
    """(x^T [BLOCK_K, BLOCK_M] fp32 as multiplied (times the norm weight with NORM; silu(gate)
    * up with ACT), its raw values' column sums of squares [BLOCK_M]); zeros past M and K."""
    mask = (offs_k < k_end)[:, None] & (offs_m < M)[None, :]
    ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None]
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if ACT:
        up = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
        x = x / (1.0 + tl.exp(-x)) * up
    ss = tl.sum(x * x, 0) if NORM else tl.zeros_like(offs_m).to(tl.float32)
    if NORM:
        g = tl.load(g_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        x = x * g[:, None]
    return x, ss


@triton.jit
def _tile_dot(
    w,  # [BLOCK_N, BLOCK_K] weight tile as loaded (x's dtype or e4m3)
    x,  # [BLOCK_K, BLOCK_M] fp32
    x_ptr,  # x's pointer: its dtype is the operands'
    IEEE: tl.constexpr, EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    """w @ x on tensor cores with fp32 accumulation; both operands in x's dtype (e4m3 widens
    exactly), x rounded to it first."""
    if EMULATE_BF16:  # the CPU interpreter (see `common.dot_flags`): bf16 values kept in fp32
        xo = round_bf16(x)
        wo = w.to(tl.float32)
    else:
        xo = x.to(x_ptr.dtype.element_ty)
        wo = w.to(x_ptr.dtype.element_ty)
    return dot(wo, xo, IEEE, EMULATE_BF16)


# M only enters the masks: one compiled variant for every row count.
@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(
    x_ptr,  # [M, K], rows `stride_xm` apart, unit column stride ([M, 2K] if ACT)
    w_ptr,  # [N, K] (any strides), x's dtype or e4m3
    y_ptr,  # [M, N] contiguous
    b_ptr,  # [N] (HAS_BIAS)
    r_ptr,  # [M, N] residual, contiguous (HAS_RES)
    g_ptr,  # [K] RMSNorm weight (NORM)
    s_ptr,  # W_SCALE 1: [N] fp32; 2: [cdiv(N, 128), cdiv(K, 128)] fp32
    part_ptr,  # [tiles, SPLIT_K, BLOCK_N, BLOCK_M] fp32 partial products (SPLIT_K > 1)
    ss_ptr,  # [tiles, SPLIT_K, BLOCK_M] fp32 partial sums of squares (SPLIT_K > 1)
    counter_ptr,  # [tiles] int32, zero between launches (SPLIT_K > 1)
    M, N, K, stride_xm, stride_wn, stride_wk, stride_sn, eps, HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr, NORM: tl.constexpr, ACT: tl.constexpr,
    W_SCALE: tl.constexpr,  # 0: none, 1: per output row, 2: per 128 x 128 block
    SPLIT_K: tl.constexpr, IEEE: tl.constexpr, EMULATE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    # This split's K steps: [k_lo, k_hi) in units of BLOCK_K.
    steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(steps, SPLIT_K)
    k_lo = split * per_split
    k_hi = tl.minimum(k_lo + per_split, steps)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    s_rows = s_ptr + (offs_n // 128).to(tl.int64) * stride_sn  # W_SCALE == 2
    # The first weight tile does not depend on the previous kernel: it is read before the PDL
    # wait and multiplied after the loop over the others.
    k0 = k_lo * BLOCK_K + offs_k
    k_end = tl.minimum(K, k_hi * BLOCK_K)  # a split past the last step gets an empty tile
    first_mask = mask_n[:, None] & (k0 < k_end)[None, :]
    # (Weights are read once: evict_first keeps x and the next layer's inputs in L2.)
    w0 = tl.load(
        w_rows + k0[None, :] * stride_wk, mask=first_mask, other=0.0, eviction_policy="evict_first"
    )
    pdl_prologue(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for step in range(k_lo + 1, k_hi):
        kk = step * BLOCK_K + offs_k
        mask = mask_n[:, None] & (kk < K)[None, :]
        w = tl.load(
            w_rows + kk[None, :] * stride_wk, mask=mask, other=0.0, eviction_policy="evict_first"
        )
        x, sq = _x_tile(x_ptr, g_ptr, kk, offs_m, M, K, K, stride_xm, NORM, ACT)
        part = _tile_dot(w, x, x_ptr, IEEE, EMULATE_BF16)
        if W_SCALE == 2:  # each 128-column step's fp32 dot times its block's scale
            part = part * tl.load(s_rows + step, mask=mask_n, other=0.0)[:, None]
        acc += part
        ss += sq
    # The first tile (all zeros for a split with no K steps).
    x, sq = _x_tile(x_ptr, g_ptr, k0, offs_m, M, K, k_end, stride_xm, NORM, ACT)
    part = _tile_dot(w0, x, x_ptr, IEEE, EMULATE_BF16)
    if W_SCALE == 2:
        first = tl.minimum(k_lo, steps - 1)  # (an empty tile's scale is never out of range)
        part = part * tl.load(s_rows + first, mask=mask_n, other=0.0)[:, None]
    acc += part
    ss += sq
    if SPLIT_K == 1:
        _epilogue(acc, ss, y_ptr, b_ptr, r_ptr, s_ptr, offs_n, offs_m, M, N, K, eps,
                  HAS_BIAS, HAS_RES, NORM, W_SCALE, EMULATE_BF16)  # fmt: skip
    else:
        _split_done(acc, ss, y_ptr, b_ptr, r_ptr, s_ptr, part_ptr, ss_ptr, counter_ptr, tile,
                    split, offs_n, offs_m, M, N, K, eps, HAS_BIAS, HAS_RES, NORM, W_SCALE,
                    SPLIT_K, BLOCK_M, BLOCK_N, EMULATE_BF16)  # fmt: skip


@triton.jit
def _split_done(
    acc, ss, y_ptr, b_ptr, r_ptr, s_ptr, part_ptr, ss_ptr, counter_ptr, tile, split, offs_n,
    offs_m, M, N, K, eps, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, NORM: tl.constexpr,
    W_SCALE: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    """Store this split's partials; the tile's last split to get here adds them all (in split
    order) and runs the epilogue. The barrier and the counter's release/acquire order every
    split's stores before the last one's loads (which bypass L1)."""
    tile_base = tile.to(tl.int64) * SPLIT_K
    rows = tl.arange(0, BLOCK_N)
    cell = rows[:, None] * BLOCK_M + offs_m[None, :]
    tl.store(part_ptr + (tile_base + split) * (BLOCK_N * BLOCK_M) + cell, acc)
    tl.store(ss_ptr + (tile_base + split) * BLOCK_M + offs_m, ss)
    tl.debug_barrier()
    counter = counter_ptr + tile
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
        tl.store(counter, 0)  # zero again for the next launch (or CUDA-graph replay)
        total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        total_ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for s in range(0, SPLIT_K):
            at = tile_base + s
            total += tl.load(part_ptr + at * (BLOCK_N * BLOCK_M) + cell, cache_modifier=".cg")
            total_ss += tl.load(ss_ptr + at * BLOCK_M + offs_m, cache_modifier=".cg")
        _epilogue(total, total_ss, y_ptr, b_ptr, r_ptr, s_ptr, offs_n, offs_m, M, N, K, eps,
                  HAS_BIAS, HAS_RES, NORM, W_SCALE, EMULATE_BF16)  # fmt: skip


@triton.jit
def _epilogue(
    acc,  # [BLOCK_N, BLOCK_M] fp32: y^T before the epilogue
    ss,  # [BLOCK_M] fp32 sums of squares of x's rows (NORM)
    y_ptr, b_ptr, r_ptr, s_ptr, offs_n, offs_m, M, N, K, eps,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, NORM: tl.constexpr, W_SCALE: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    mask_n = offs_n < N
    if W_SCALE == 1:
        acc = acc * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)[:, None]
    if NORM:
        acc = acc * (1.0 / tl.sqrt(ss / K + eps))[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    out = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
    mask = mask_n[:, None] & (offs_m < M)[None, :]
    if HAS_RES:
        acc += tl.load(r_ptr + out, mask=mask, other=0.0).to(tl.float32)
    if EMULATE_BF16:  # the interpreter's own cast truncates
        acc = round_bf16(acc)
    tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=mask)


def skinny_supported(x: torch.Tensor, weight: torch.Tensor, max_rows: int = MAX_ROWS) -> bool:
    """1..min(max_rows, 16) rows of x with a unit column stride, a float dtype shared with the
    weight or an e4m3 weight."""
    return gemv_supported(x, weight, min(max_rows, MAX_ROWS))


def skinny(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6, act: bool = False, config: SkinnyConfig | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """`minisgl.kernels.gemv.gemv.gemv`'s call (the same arguments, 1 <= M <= 16 rows; a drop-in
    for its few-row uses)."""
    assert skinny_supported(x, weight, x.shape[0])
    m, n, k, w_scale = check_fused_linear(x, weight, bias, residual, norm_weight, act, weight_scale)
    cfg = config or default_config(n, k, act, FORMATS[w_scale], num_sms(x.device))
    if w_scale == 2:
        assert cfg.block_k == SCALE_BLOCK, "block-scaled weights take 128 columns per K step"
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(n, cfg.block_n)
    split = max(1, min(cfg.split_k, triton.cdiv(k, cfg.block_k)))
    if split > 1:
        part = torch.empty(tiles, split, cfg.block_n, BLOCK_M, dtype=torch.float32, device=x.device)
        ss = torch.empty(tiles, split, BLOCK_M, dtype=torch.float32, device=x.device)
        counters = split_counters(x.device, tiles)
    else:
        part = ss = counters = y  # unread
    tensors, sizes, flags = launch_args(x, weight, y, bias, residual, norm_weight, weight_scale,
                                        eps, act)  # fmt: skip
    ieee, emulate_bf16 = dot_flags(x.dtype, _skinny_kernel)
    _skinny_kernel[(tiles, split)](
        *tensors, part, ss, counters, *sizes, SPLIT_K=split, IEEE=ieee, EMULATE_BF16=emulate_bf16,
        BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **flags,
    )  # fmt: skip
    return y
