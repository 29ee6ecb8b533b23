"""Linear layers of a few rows (batch-1 decode) on CUDA cores, with the work around them fused
in: y[M, N] = epilogue(W[N, K] @ prologue(x[M, K])).

At batch 1 a linear layer is a pure read of its weight; what costs is every kernel boundary and
cuBLAS's own split-K reduce kernels. So the prologue can apply RMSNorm to x (`norm_weight`: x^2
summed on the way, the dot products scaled by the rstd at the end) or SiLU-and-multiply (`act`:
x is [2K], gate then up); the epilogue can add a bias and a residual; each program loads its
first weight tile before the programmatic-dependent-launch wait and double-buffers weights and x
in registers. fp32 products and sums (the normalised x is not rounded to the model dtype first:
results agree with the torch layers within bf16 rounding).

FP8 weights (`weight_scale`): e4m3 rows widened in registers, one scale per output row or per
128 x 128 block (folded into x; a program's rows lie in one block row). At one row FP8 is bound
by instructions: at the copy bandwidth an H200 SM takes in ~16 e4m3 weights a clock and issues
128 thread instructions. Hence two layouts (`GemvConfig.layout`):

- "tile" (`_gemv_kernel`): a [BLOCK_N, BLOCK_K] fp32 partial sum per program and row of x,
  reduced once at the end; several rows of x run as neighbouring programs (all but the first
  read the weight tile from L2). The 16-bit default.
- "vec" (`_gemv_rows_kernel`, `TUNED_FP8`): every tile is 4-d, [ROWS, BLOCK_N, BLOCK_K / VEC,
  VEC], with all threads and warps along K (BLOCK_K / VEC >= 32 x warps, asserted on CUDA): a
  thread holds VEC columns of all BLOCK_N weight rows and all ROWS rows of x, so weights, x and
  their product share one layout (no conversion in the loop; `tests/kernels/test_gemv.py` checks
  the compiled loop) and the sum over K across threads happens once, at the end. For e4m3: 16
  columns a thread (one 16-byte load), kept packed as int32 words (`words`), each word widened
  by the hardware conversion of its two 16-bit halves in inline PTX (`widen` "ptx"), one fp32
  partial sum per column (`keep_vec`: one FMA a weight): ~3.6-3.9 instructions a weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minisgl.kernels.common import is_interpreted, pdl_args, pdl_prologue
from minisgl.kernels.fp8 import weight_scale_kind


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 16
    block_k: int = 512
    num_warps: int = 4
    layout: str = "tile"  # or "vec" (the module docstring); the knobs below are the vec layout's
    x_ahead: bool = True  # x read one K step ahead (two steps in registers), else at its step
    vec: int = 0  # columns of a K step a thread sums (0: one 16-byte load of x, `rows_vec`)
    # e4m3 widened by "cvt" (the conversion to f16x2, then fp32) or, with `words` on CUDA, "ptx"
    # (inline PTX on each int32's two 16-bit halves; the interpreter cannot run it).
    widen: str = "cvt"
    keep_vec: bool = False  # a partial sum per column (FMAs, VEC x the registers), not per VEC
    # e4m3 weights loaded as int32 words, each meeting x split by byte position (packed bytes)
    words: bool = False


# (N, K, act) -> config measured best on an H200 (bf16, `python -m minisgl.benchmark.tune gemv`);
# `default_config`'s guess for the rest (within 1% of the best for the Llama-3-8B qkv, o_proj).
TUNED: dict[tuple[int, int, bool], GemvConfig] = {
    (28672, 4096, False): GemvConfig(16, 256, 4),  # Llama-3-8B gate/up: 56.3 us
    (4096, 14336, True): GemvConfig(8, 512, 8),  # Llama-3-8B down after SiLU: 28.7 us
    (128256, 4096, False): GemvConfig(32, 256, 4),  # Llama-3 LM head: 238.4 us
    (5120, 2048, False): GemvConfig(4, 256, 4),  # Qwen3-30B-A3B qkv: 7.07 us
    (2048, 4096, False): GemvConfig(4, 1024, 8),  # Qwen3-30B-A3B o_proj: 5.28 us
    (128, 2048, False): GemvConfig(2, 2048, 8),  # Qwen3-30B-A3B router (one-row MoE sweep)
}


# The same for FP8 (e4m3) weights (`... tune gemv --fp8` on the H200); other shapes take the bf16
# table's. Llama-3-8B, us (TB/s of e4m3 weights): qkv 9.37 (2.69), o_proj 5.37 (3.13), gate_up
# 33.2 (3.54), down 16.6 (3.54), LM head 134.9 (3.89); Qwen3-30B-A3B qkv 5.63, o_proj 3.64.
TUNED_FP8: dict[tuple[int, int, bool], GemvConfig] = {
    (6144, 4096, False): GemvConfig(8, 2048, 4, layout="vec", vec=16, widen="ptx", keep_vec=True, words=True),
    (4096, 4096, False): GemvConfig(4, 2048, 4, layout="vec", vec=16, widen="ptx", words=True),
    (28672, 4096, False): GemvConfig(8, 2048, 4, layout="vec", vec=16, widen="ptx", words=True),
    (4096, 14336, True): GemvConfig(8, 2048, 4, layout="vec", vec=16, widen="ptx", words=True),
    (128256, 4096, False): GemvConfig(8, 2048, 4, layout="vec", vec=16, widen="ptx", words=True),
    (5120, 2048, False): GemvConfig(8, 2048, 4, layout="vec", x_ahead=False, vec=16, widen="ptx", keep_vec=True, words=True),
    (2048, 4096, False): GemvConfig(4, 2048, 4, layout="vec", vec=16, widen="ptx", words=True),
}  # fmt: skip


# `GemvConfig.widen` -> the kernels' WIDEN.
WIDEN = {"cvt": 0, "ptx": 2}


def default_config(n: int, k: int, act: bool = False, fp8: bool = False) -> GemvConfig:
    """The measured config for this shape, else what did well across the measured ones."""
    if fp8 and (n, k, act) in TUNED_FP8:
        return TUNED_FP8[(n, k, act)]
    return TUNED.get((n, k, act)) or GemvConfig(8, 1024 if k >= 1024 else 256, 4)


def rows_vec(x: torch.Tensor) -> int:
    """Columns of a K step summed in one thread's registers: one 16-byte load of x (8 for a
    16-bit x; then 16 bytes of a 16-bit weight, 8 of an e4m3 one)."""
    return 16 // x.element_size()


@triton.jit
def _load_x(x_ptr, offs, K, ACT: tl.constexpr, rows=True):
    """x[offs] in fp32 (0 past K and where `rows` is False); with ACT, silu(x[offs]) *
    x[K + offs]."""
    mask = (offs < K) & rows
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT:
        up = tl.load(x_ptr + K + offs, mask=mask, other=0.0).to(tl.float32)
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


# `M` (rows of x) is specialized: at M == 1 (batch-1 decode) the row arithmetic folds away (the
# H200's W2 step took 0.4 ms longer with M a plain runtime value).
@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K], rows `stride_xm` apart ([M, 2K] if ACT)
    w_ptr,  # [N, K]
    y_ptr,  # [M, N] contiguous
    b_ptr,  # [N] (HAS_BIAS)
    r_ptr,  # [M, N] residual, contiguous (HAS_RES)
    g_ptr,  # [K] RMSNorm weight (NORM)
    s_ptr,  # W_SCALE 1: [N] fp32 per row; 2: [cdiv(N, 128), cdiv(K, 128)] fp32 per block
    M, N, K, stride_xm, stride_wn, stride_wk, stride_sn, eps, HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr, NORM: tl.constexpr, ACT: tl.constexpr,
    W_SCALE: tl.constexpr,  # 0: none, 1: per row, 2: per 128 x 128 block (FP8 weights)
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # Programs of the same weight rows (one per row of x) are neighbours: one DRAM read each.
    row = tl.program_id(0) % M
    offs_n = (tl.program_id(0) // M) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk
    x_ptr += row.to(tl.int64) * stride_xm
    s_row = s_ptr + ((tl.program_id(0) // M) * BLOCK_N // 128).to(tl.int64) * stride_sn
    # The first weight tile and the norm weight do not depend on the previous kernel: they are
    # read before the PDL wait (after it: slower at every Llama-3-8B and Qwen3-30B-A3B shape).
    m0 = mask_n[:, None] & (offs_k < K)[None, :]
    w = tl.load(rows, mask=m0, other=0.0, eviction_policy="evict_first")
    if NORM:
        g = tl.load(g_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
    s = _block_scales(s_row, offs_k, K, W_SCALE)
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
    rstd = 1.0
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(ss, 0) / K + eps)
    out = row.to(tl.int64) * N + offs_n
    _epilogue(tl.sum(acc, 1), rstd, y_ptr, b_ptr, r_ptr, s_ptr, offs_n, mask_n, out, mask_n,
              HAS_BIAS, HAS_RES, NORM, W_SCALE)  # fmt: skip


@triton.jit
def _x_rows_tile(
    x_rows,  # [ROWS, 1, 1, 1] pointers to the rows of x
    g_ptr, s_row,
    cols,  # [ROWS, 1, BLOCK_K // VEC, VEC]: the columns of a K step, the same in every row
    K,
    rows,  # [ROWS, 1, 1, 1]: rows of x below M
    ACT: tl.constexpr, NORM: tl.constexpr, W_SCALE: tl.constexpr,
):  # fmt: skip
    """(x at `cols` times the norm weight (NORM) and the block scales (W_SCALE 2), fp32; the
    sums of squares of its raw values [ROWS, 1, BLOCK_K // VEC] (zeros without NORM)). The norm
    weight and scales are read as [ROWS, ...] tiles: a [1, ...] tile would get a layout of its
    own, and the product a shared-memory round trip each step."""
    x = _load_x(x_rows, cols, K, ACT, rows)
    if NORM:
        ss = tl.sum(x * x, 3)
        x = x * tl.load(g_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    else:
        ss = tl.zeros_like(tl.sum(x, 3))
    if W_SCALE == 2:
        x = x * _block_scales(s_row, cols, K, W_SCALE)
    return x, ss


@triton.jit
def _x_step(
    x_rows, g_ptr, s_row,
    cols,  # [ROWS, 1, BLOCK_K // VEC, XV]: the first XV of each thread's VEC columns
    K,
    rows,  # [ROWS, 1, 1, 1]: rows of x below M
    ACT: tl.constexpr, NORM: tl.constexpr, W_SCALE: tl.constexpr, HALVES: tl.constexpr,
    XV: tl.constexpr,
):  # fmt: skip
    """x of a K step as `_x_rows_tile` gives it: (x at `cols`, x at the next XV columns with
    HALVES 2 (else x again), the sums of squares)."""
    x, ss = _x_rows_tile(x_rows, g_ptr, s_row, cols, K, rows, ACT, NORM, W_SCALE)
    x2 = x
    if HALVES == 2:
        x2, ss2 = _x_rows_tile(x_rows, g_ptr, s_row, cols + XV, K, rows, ACT, NORM, W_SCALE)
        ss += ss2
    return x, x2, ss


@triton.jit
def _step_sums(
    acc,  # [ROWS, BLOCK_N, S, ACC_W] fp32 partial sums
    w,  # [1, BLOCK_N, S, VEC] weights of a K step ([.., VEC // 4] int32 with WORDS)
    x, x2,  # [ROWS, 1, S, XV] x at a thread's first XV columns, and its next XV (HALVES 2)
    WIDEN: tl.constexpr, HALVES: tl.constexpr, KEEP_VEC: tl.constexpr, WORDS: tl.constexpr,
    ROWS: tl.constexpr, S: tl.constexpr, XV: tl.constexpr,
):  # fmt: skip
    """`acc` plus the step's products, summed over each thread's VEC columns or (KEEP_VEC) one
    partial sum per column. With HALVES 2 (16 e4m3 weights against two 16-byte loads of x) the
    halves of x are joined in registers into the weights' layout (no instructions); with WORDS
    each int32 of weights meets x split by byte position (x[4i + j] for byte j of word i)."""
    if HALVES == 2:
        x = tl.reshape(tl.permute(tl.join(x, x2), [0, 1, 2, 4, 3]), [ROWS, 1, S, 2 * XV])
    if WORDS:
        even, odd = tl.split(tl.reshape(x, [ROWS, 1, S, 2 * XV // 4, 2, 2]))
        xb0, xb2 = tl.split(even)
        xb1, xb3 = tl.split(odd)
        wb0, wb1, wb2, wb3 = _bytes(w, WIDEN)
        if KEEP_VEC:  # one FMA per weight into each column's sum
            acc += wb0 * xb0
            acc += wb1 * xb1
            acc += wb2 * xb2
            acc += wb3 * xb3
        else:
            acc += tl.sum(wb0 * xb0 + wb1 * xb1 + wb2 * xb2 + wb3 * xb3, 3, keep_dims=True)
    elif KEEP_VEC:
        acc += w.to(tl.float32) * x
    else:
        acc += tl.sum(w.to(tl.float32) * x, 3, keep_dims=True)
    return acc


@triton.jit
def _bytes(words, WIDEN: tl.constexpr):
    """The four e4m3 bytes of each int32 (byte j: column 4i + j) in fp32. WIDEN 2 (CUDA, inline
    PTX): one conversion of each 16-bit half to f16x2, then to fp32 (1.5 instructions a weight)."""
    if WIDEN == 2:
        b0, b1, b2, b3 = tl.inline_asm_elementwise(
            asm="""{
            .reg .b16 lo, hi, a, b, c, d;
            .reg .b32 p, q;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 p, lo;
            cvt.rn.f16x2.e4m3x2 q, hi;
            mov.b32 {a, b}, p;
            mov.b32 {c, d}, q;
            cvt.f32.f16 $0, a;
            cvt.f32.f16 $1, b;
            cvt.f32.f16 $2, c;
            cvt.f32.f16 $3, d;
            }""",
            constraints="=f,=f,=f,=f,r",
            args=[words],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )
    else:
        b0 = _byte(words, 0)
        b1 = _byte(words, 1)
        b2 = _byte(words, 2)
        b3 = _byte(words, 3)
    return b0, b1, b2, b3


@triton.jit
def _byte(words, J: tl.constexpr):
    """Byte J of each int32 of e4m3 weights in fp32 (the hardware conversion)."""
    out = ((words >> (8 * J)) & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    return out.to(tl.float32)


@triton.jit
def _steps_cols(S: tl.constexpr, W: tl.constexpr):
    """[S, W] offsets s * W + w: a K step's columns (or words) as S pieces of W, each one
    thread's. Declared contiguous in pairs along S (they are not), so that triton 3.6 and 3.9
    both lay the threads along S (ties in contiguity are broken in opposite directions), not
    over the weight rows; loads still vectorize along W alone."""
    return tl.max_contiguous(tl.arange(0, S)[:, None] * W + tl.arange(0, W)[None, :], [2, W])


# M only enters the masks (rows past it are zeros): one compiled variant per ROWS.
@triton.jit(do_not_specialize=["M"])
def _gemv_rows_kernel(
    # the tensors, sizes and flags of `_gemv_kernel`
    x_ptr, w_ptr, y_ptr, b_ptr, r_ptr, g_ptr, s_ptr, M, N, K, stride_xm, stride_wn, stride_wk,
    stride_sn, eps, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, NORM: tl.constexpr,
    ACT: tl.constexpr, W_SCALE: tl.constexpr,
    X_AHEAD: tl.constexpr,  # x read one K step ahead of its use, else at its step
    ROWS: tl.constexpr,  # M rounded up to a power of two
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    VEC: tl.constexpr,  # columns of a K step summed in a thread's registers
    XV: tl.constexpr,  # columns of x in one 16-byte load (8 for a 16-bit x)
    HALVES: tl.constexpr,  # VEC // XV: 1, or 2 (16 e4m3 weights against two loads of x)
    KEEP_VEC: tl.constexpr,  # partial sums per column (FMAs), not per VEC (`_step_sums`)
    WORDS: tl.constexpr,  # e4m3 weights read as int32 words (`_step_sums`)
    ACC_W: tl.constexpr,  # partial sums per thread, row and VEC columns (1 without KEEP_VEC)
    WIDEN: tl.constexpr,  # e4m3 to fp32 with WORDS: 0 conversion, 2 inline PTX (`_bytes`)
    PDL: tl.constexpr,
):  # fmt: skip
    """All M rows of x for BLOCK_N weight rows: each weight tile read once, M products each
    (the module docstring says how the partial sums are laid out)."""
    tile = tl.program_id(0)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, ROWS)
    mask_m = offs_m < M
    # Every tile is 4-d, [rows of x, rows of W, BLOCK_K // VEC, VEC] (size 1 where it does not
    # vary), so that the product of a weight tile and x needs no layout change: a K step's
    # columns as [BLOCK_K // VEC, VEC], whose last axis is summed every step in registers.
    # The weights in units of U columns: one column, or (WORDS) an int32 of four e4m3 ones.
    U: tl.constexpr = 1 + 3 * WORDS
    S: tl.constexpr = BLOCK_K // VEC
    offs_k = _steps_cols(S, VEC // U)[None, None]
    k_u = K // U  # (WORDS: K is a multiple of 4)
    n4 = offs_n[None, :, None, None]
    m4 = mask_m[:, None, None, None]
    if WORDS:  # [1, BLOCK_N, S, VEC // 4] int32 (the loaded bytes stay packed in registers)
        rows = w_ptr.to(tl.pointer_type(tl.int32)) + n4.to(tl.int64) * (stride_wn // 4) + offs_k
    else:  # [1, BLOCK_N, S, VEC]
        rows = w_ptr + n4.to(tl.int64) * stride_wn + offs_k * stride_wk
    x_rows = x_ptr + offs_m[:, None, None, None].to(tl.int64) * stride_xm  # [ROWS, 1, 1, 1]
    s_row = s_ptr + (tile * BLOCK_N // 128).to(tl.int64) * stride_sn
    w = tl.load(rows, mask=(n4 < N) & (offs_k < k_u), other=0.0, eviction_policy="evict_first")
    pdl_prologue(PDL)  # the first weight tile is read before the wait
    m0 = 0 * offs_m[:, None, None, None]  # broadcasts a K step's columns to every row
    # x's columns: a thread's first XV of its VEC (all of them unless HALVES), in every row
    xk = (_steps_cols(S, XV) + (VEC - XV) * tl.arange(0, S)[:, None])[None, None] + m0
    ss = tl.zeros([ROWS, 1, S], dtype=tl.float32)
    if X_AHEAD:
        x, x2, ss = _x_step(x_rows, g_ptr, s_row, xk, K, m4, ACT, NORM, W_SCALE, HALVES, XV)
    acc = tl.zeros([ROWS, BLOCK_N, S, ACC_W], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kn = (k0 + BLOCK_K) // U + offs_k
        w_next = tl.load(rows + (k0 + BLOCK_K) // U * stride_wk, mask=(n4 < N) & (kn < k_u),
                         other=0.0, eviction_policy="evict_first")  # fmt: skip
        if X_AHEAD:  # the next step's x (two steps of x in registers)
            x_next, x2_next, sq = _x_step(x_rows, g_ptr, s_row, xk + k0 + BLOCK_K, K, m4, ACT,
                                          NORM, W_SCALE, HALVES, XV)  # fmt: skip
        else:  # this step's (one step; its L1 / L2 latency hidden by the other warps)
            x, x2, sq = _x_step(x_rows, g_ptr, s_row, xk + k0, K, m4, ACT, NORM, W_SCALE, HALVES,
                                XV)  # fmt: skip
        acc = _step_sums(acc, w, x, x2, WIDEN, HALVES, KEEP_VEC, WORDS, ROWS, S, XV)
        ss += sq
        w = w_next
        if X_AHEAD:
            x = x_next
            x2 = x2_next
    y = tl.sum(tl.sum(acc, 3), 2)
    rstd = 1.0
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(ss, 2), 1) / K + eps)[:, None]
    out = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    _epilogue(y, rstd, y_ptr, b_ptr, r_ptr, s_ptr, offs_n[None, :], mask_n[None, :], out,
              mask_m[:, None] & mask_n[None, :], HAS_BIAS, HAS_RES, NORM, W_SCALE)  # fmt: skip


@triton.jit
def _epilogue(
    y,  # [BLOCK_N] or [ROWS, BLOCK_N] fp32: W x for the program's rows
    rstd,  # a scalar or [ROWS, 1]: the RMSNorm of each row of x (NORM)
    y_ptr, b_ptr, r_ptr, s_ptr,
    offs_n,  # the output columns, shaped to broadcast against y
    mask_n,  # offs_n < N
    out,  # y's offsets in the [M, N] output (and residual)
    mask,  # y's valid entries
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, NORM: tl.constexpr, W_SCALE: tl.constexpr,
):  # fmt: skip
    """Per-row FP8 scales, the rstd, bias, residual; one store in the output dtype."""
    if W_SCALE == 1:
        y = y * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)
    if NORM:
        y = y * rstd
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if HAS_RES:
        y += tl.load(r_ptr + out, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + out, y.to(y_ptr.dtype.element_ty), mask=mask)


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


# The vec layout keeps every row of x in one program's registers: more rows run in chunks of
# this many (the sm_90 build of the 8B FP8 tiles is at 254-255 registers from 4 rows on).
VEC_MAX_ROWS = 8


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
    assert gemv_supported(x, weight, x.shape[0])
    m, n, k, w_scale = check_fused_linear(x, weight, bias, residual, norm_weight, act, weight_scale)
    rows = triton.next_power_of_2(m)
    cfg = config or default_config(n, k, act, w_scale != 0)
    rows_kernel = cfg.layout == "vec"
    if rows_kernel and m > VEC_MAX_ROWS:  # one program holds every row: chunks of rows
        chunks = [
            gemv(x[lo : lo + VEC_MAX_ROWS], weight, bias,
                 None if residual is None else residual[lo : lo + VEC_MAX_ROWS], norm_weight,
                 eps, act, cfg, weight_scale)
            for lo in range(0, m, VEC_MAX_ROWS)
        ]  # fmt: skip
        return torch.cat(chunks)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    tensors, sizes, flags = launch_args(x, weight, y, bias, residual, norm_weight, weight_scale,
                                        eps, act)  # fmt: skip
    flags |= dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps)
    if w_scale == 2:
        assert 128 % cfg.block_n == 0, "a program's rows must lie in one 128-row block"
    tiles = triton.cdiv(n, cfg.block_n)
    if not rows_kernel:
        assert cfg.layout == "tile" and cfg.widen == "cvt", "the vec layout's knobs"
        _gemv_kernel[(tiles * m,)](*tensors, *sizes, **flags)
        return y
    _gemv_rows_kernel[(tiles,)](*tensors, *sizes, ROWS=rows, **flags, **_vec_flags(cfg, x, weight))
    return y


def _vec_flags(cfg: GemvConfig, x: torch.Tensor, weight: torch.Tensor) -> dict[str, int | bool]:
    """The vec layout's launch flags (`_gemv_rows_kernel`), checked."""
    x_vec = rows_vec(x)
    vec = cfg.vec or x_vec
    assert cfg.block_k % vec == 0 and vec in (x_vec, 2 * x_vec), "VEC: one or two loads of x"
    # On the GPU every thread must own whole VEC-column pieces of a K step, no two threads the
    # same ones (the module docstring says why); the interpreter has no threads.
    assert not x.is_cuda or cfg.block_k // vec >= 32 * cfg.num_warps, "BLOCK_K too small"
    if cfg.words:
        assert weight.dtype == torch.float8_e4m3fn and weight.stride(1) == 1, "words: e4m3 rows"
        assert vec == 16 and weight.shape[1] % 4 == 0, "words: 16 columns a thread"
    assert cfg.widen != "ptx" or (cfg.words and not is_interpreted(_gemv_rows_kernel)), "ptx"
    acc_w = (vec // 4 if cfg.words else vec) if cfg.keep_vec else 1
    return dict(X_AHEAD=cfg.x_ahead, VEC=vec, XV=x_vec, HALVES=vec // x_vec,
                KEEP_VEC=cfg.keep_vec, WORDS=cfg.words, ACC_W=acc_w, WIDEN=WIDEN[cfg.widen])  # fmt: skip


def launch_args(
    x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None,
    residual: torch.Tensor | None, norm_weight: torch.Tensor | None,
    weight_scale: torch.Tensor | None, eps: float, act: bool,
) -> tuple[tuple[torch.Tensor, ...], tuple[int | float, ...], dict[str, int | bool]]:  # fmt: skip
    """The arguments a fused linear kernel of a few rows (`gemv`, `skinny.skinny`) starts with:
    (its tensors, `y` where one is absent (never read); its sizes and strides; its flags)."""
    scale = weight_scale if weight_scale is not None else y
    tensors = (x, weight, y, bias if bias is not None else y,
               residual if residual is not None else y,
               norm_weight if norm_weight is not None else x, scale)  # fmt: skip
    sizes = (x.shape[0], *weight.shape, x.stride(0), weight.stride(0), weight.stride(1),
             scale.stride(0), eps)  # fmt: skip
    flags = dict(HAS_BIAS=bias is not None, HAS_RES=residual is not None,
                 NORM=norm_weight is not None, ACT=act,
                 W_SCALE=weight_scale_kind(weight, weight_scale), **pdl_args(x.device))  # fmt: skip
    return tensors, sizes, flags


def check_fused_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    residual: torch.Tensor | None, norm_weight: torch.Tensor | None, act: bool,
    weight_scale: torch.Tensor | None,
) -> tuple[int, int, int, int]:  # fmt: skip
    """The shapes of a fused linear call of a few rows (`gemv`, `skinny.skinny`):
    (M, N, K, the W_SCALE variant)."""
    m = x.shape[0]
    n, k = weight.shape
    assert x.shape[1] == (2 * k if act else k)
    assert not (act and norm_weight is not None)
    assert bias is None or bias.shape == (n,)
    assert residual is None or (residual.shape == (m, n) and residual.is_contiguous())
    assert norm_weight is None or norm_weight.shape == (k,)
    return m, n, k, weight_scale_kind(weight, weight_scale)
