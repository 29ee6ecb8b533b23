"""The MoE pair path: one GEMV per (token, k) pair, no sort (a few tokens), in two launches:
gate/up (routing inside, optionally the RMSNorm) and down (summing the token's experts, optionally
adding the residual); e4m3 experts in the one-row GEMV's vec layout."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from minisgl.kernels.common import is_interpreted, pdl_args, pdl_prologue
from minisgl.kernels.fp8 import expert_scale_args
from minisgl.kernels.gemv.gemv import WIDEN, _block_scales, _bytes, _steps_cols, _x_step
from minisgl.kernels.moe.routing import _route, _topk_block
from minisgl.kernels.moe.tiles import GemmTile, PairConfig, VecTile

# ---- pair path: one GEMV per (token, k) pair, no sort --------------------------------------------


@triton.jit
def _pair_expert(
    ids_ptr, weights_ptr, logits_ptr, pair, token, pid_n, stride_l, num_experts,
    TOP_K: tl.constexpr, ROUTE: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):  # fmt: skip
    """The expert of a gate/up program's pair: read from `ids_ptr`, or with ROUTE chosen from
    the token's router logits (and, by the pid_n == 0 programs, published with its weight)."""
    if ROUTE:
        vals, idxs = _route(
            logits_ptr, token, stride_l, num_experts, TOP_K, BLOCK_TOPK, BLOCK_E, RENORMALIZE
        )
        slot = tl.arange(0, BLOCK_TOPK) == pair % TOP_K
        expert = tl.sum(tl.where(slot, idxs, 0), 0)
        if pid_n == 0:
            tl.store(ids_ptr + pair, expert)
            tl.store(weights_ptr + pair, tl.sum(tl.where(slot, vals, 0.0), 0))
    else:
        expert = tl.load(ids_ptr + pair)
    return expert


@triton.jit
def _pair_gate_up_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2I, H]: gate rows [0, I), up rows [I, 2I)
    act_ptr,  # [T * K, I]: silu(gate) * up of pair t * K + k
    ids_ptr,  # [T * K] int32: read, or written when ROUTE
    weights_ptr,  # [T * K] fp32: written when ROUTE
    logits_ptr,  # [T, E] router logits, read when ROUTE
    norm_ptr,  # [H] RMSNorm weight (NORM)
    s_ptr,  # e4m3 w: [E, 2I] fp32 per row (W_SCALE 1), [E, 2I/128, H/128] per block (2)
    inter,  # I
    hidden,  # H
    num_experts, eps, stride_xt, stride_we, stride_wn, stride_wk, stride_at, stride_l, stride_se,
    stride_sn, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ROUTE: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr, NORM: tl.constexpr, W_SCALE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    # Program (p, n): pair p = t * K + k x columns [n * BLOCK_N, +BLOCK_N) of I. With ROUTE every
    # program of token t routes t again (cheaper than a launch; all agree: the same code on the
    # same logits) and the n == 0 programs publish the result for the down kernel.
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    token = (pair // TOP_K).to(tl.int64)
    expert = _pair_expert(ids_ptr, weights_ptr, logits_ptr, pair, token, pid_n, stride_l,
                          num_experts, TOP_K, ROUTE, BLOCK_TOPK, BLOCK_E, RENORMALIZE)  # fmt: skip
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < inter
    x_ptrs = x_ptr + token * stride_xt + offs_k  # [BLOCK_K]
    g_ptrs = (
        w_ptr
        + expert.to(tl.int64) * stride_we
        + offs_n[:, None] * stride_wn
        + offs_k[None, :] * stride_wk
    )  # [BLOCK_N, BLOCK_K]
    u_ptrs = g_ptrs + inter * stride_wn
    # FP8 experts with 128 x 128 block scales: a program's gate (and up) rows lie in one block
    # row, so the scales are a vector over k, folded into x.
    s_expert = s_ptr + expert.to(tl.int64) * stride_se
    sg_row = s_expert + (pid_n * BLOCK_N // 128) * stride_sn
    su_row = s_expert + ((inter + pid_n * BLOCK_N) // 128) * stride_sn
    # Products summed per lane in fp32, reduced across K once at the end. Triton pipelines only
    # a tl.dot's loads, so the loop prefetches tile k + 1 by hand while tile k is multiplied.
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    mask_k = offs_k < hidden
    a = tl.load(x_ptrs, mask=mask_k, other=0.0)
    g = tl.load(g_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
    u = tl.load(u_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
    sg = _block_scales(sg_row, offs_k, hidden, W_SCALE)
    su = _block_scales(su_row, offs_k, hidden, W_SCALE)
    # NORM: x is RMS-normalised on the way, as in the one-row GEMV (minisgl.kernels.gemv.gemv): sum
    # x^2 over all of H, scale x by the norm weight, and the two sums by the rstd at the end.
    ss = tl.zeros([BLOCK_K], tl.float32)
    if NORM:
        nw = tl.load(norm_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    for k in range(1, tl.cdiv(hidden, BLOCK_K) + 1):
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
        mask_k = offs_k < hidden - k * BLOCK_K
        a_next = tl.load(x_ptrs, mask=mask_k, other=0.0)
        g_next = tl.load(g_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        u_next = tl.load(u_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        sg_next = _block_scales(sg_row, k * BLOCK_K + offs_k, hidden, W_SCALE)
        su_next = _block_scales(su_row, k * BLOCK_K + offs_k, hidden, W_SCALE)
        a32 = a.to(tl.float32)
        if NORM:
            nw_next = tl.load(norm_ptr + k * BLOCK_K + offs_k, mask=mask_k, other=0.0)
            ss += a32 * a32
            a32 = a32 * nw
            nw = nw_next.to(tl.float32)
        if W_SCALE == 2:
            acc_g += g.to(tl.float32) * (a32 * sg)[None, :]
            acc_u += u.to(tl.float32) * (a32 * su)[None, :]
        else:
            acc_g += g.to(tl.float32) * a32[None, :]
            acc_u += u.to(tl.float32) * a32[None, :]
        a, g, u, sg, su = a_next, g_next, u_next, sg_next, su_next
    gate = tl.sum(acc_g, 1)  # [BLOCK_N]
    up = tl.sum(acc_u, 1)
    if W_SCALE == 1:
        gate = gate * tl.load(s_expert + offs_n, mask=mask_n, other=0.0)
        up = up * tl.load(s_expert + inter + offs_n, mask=mask_n, other=0.0)
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(ss, 0) / hidden + eps)
        gate = gate * rstd
        up = up * rstd
    h = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up
    out_ptrs = act_ptr + pair.to(tl.int64) * stride_at + offs_n
    tl.store(out_ptrs, h.to(act_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _pair_down_loads(
    act_ptr,
    w_rows,  # [BLOCK_N, 1] pointers to the output rows of expert 0
    ids,  # [BLOCK_TOPK] the token's experts
    token,
    i,  # the step: (slot, I tile) = divmod(i, k_tiles); past the last step, nothing loads
    k_tiles, inter, mask_n, stride_at, stride_we, stride_wk,
    s_rows,  # [BLOCK_N] pointers to expert 0's row scales (W_SCALE 1) or [1] to its block row
    stride_se, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_TOPK: tl.constexpr,
    W_SCALE: tl.constexpr,
):  # fmt: skip
    slot = i // k_tiles
    offs = (i - slot * k_tiles) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = offs < tl.where(slot < TOP_K, inter, 0)
    expert = tl.sum(tl.where(tl.arange(0, BLOCK_TOPK) == slot, ids, 0), 0).to(tl.int64)
    pair = token * TOP_K + slot
    a = tl.load(act_ptr + pair * stride_at + offs, mask=mask_k, other=0.0)  # [BLOCK_K]
    w_ptrs = w_rows + expert * stride_we + offs[None, :] * stride_wk
    w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
    # FP8 experts: each row's scale ([BLOCK_N]), or the block row's scales over k ([BLOCK_K])
    if W_SCALE == 1:
        s = tl.load(s_rows + expert * stride_se, mask=mask_n, other=0.0)
    elif W_SCALE == 2:
        s = tl.load(s_rows + expert * stride_se + offs // 128, mask=mask_k, other=0.0)
    else:
        s = a
    return a, w, s


@triton.jit
def _pair_down_kernel(
    act_ptr,  # [T * K, I]
    w_ptr,  # [E, H, I]
    out_ptr,  # [T, H]
    ids_ptr,  # [T * K] int32
    weights_ptr,  # [T * K] fp32
    r_ptr,  # [T, H] residual (HAS_RES)
    s_ptr,  # e4m3 w: [E, H] fp32 per row (W_SCALE 1), [E, H/128, I/128] per block (2)
    hidden,  # H (the output columns)
    inter,  # I (the reduction)
    stride_at, stride_we, stride_wn, stride_wk, stride_ot, stride_rt, stride_se, stride_sn,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_TOPK: tl.constexpr,
    HAS_RES: tl.constexpr, W_SCALE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    # Program (t, n): columns [n * BLOCK_N, +BLOCK_N) of token t's output, summed over its K
    # experts in registers (no atomics): one flat loop over (k, I tile) steps, prefetching.
    token = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hidden
    offs_s = tl.arange(0, BLOCK_TOPK)
    ids = tl.load(ids_ptr + token * TOP_K + offs_s, mask=offs_s < TOP_K, other=0)
    routing = tl.load(weights_ptr + token * TOP_K + offs_s, mask=offs_s < TOP_K, other=0.0)
    w_rows = w_ptr + offs_n[:, None] * stride_wn  # [BLOCK_N, 1]
    if W_SCALE == 2:  # BLOCK_N divides 128: the program's rows lie in one block row
        s_rows = s_ptr + (pid_n * BLOCK_N // 128) * stride_sn
    else:
        s_rows = s_ptr + offs_n
    k_tiles = tl.cdiv(inter, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    a, w, s = _pair_down_loads(
        act_ptr, w_rows, ids, token, 0, k_tiles, inter, mask_n, stride_at, stride_we,
        stride_wk, s_rows, stride_se, TOP_K, BLOCK_K, BLOCK_TOPK, W_SCALE,
    )  # fmt: skip
    for i in range(1, TOP_K * k_tiles + 1):
        a_next, w_next, s_next = _pair_down_loads(
            act_ptr, w_rows, ids, token, i, k_tiles, inter, mask_n, stride_at, stride_we,
            stride_wk, s_rows, stride_se, TOP_K, BLOCK_K, BLOCK_TOPK, W_SCALE,
        )  # fmt: skip
        weight = tl.sum(tl.where(offs_s == (i - 1) // k_tiles, routing, 0.0), 0)
        a32 = a.to(tl.float32) * weight
        if W_SCALE == 1:  # a scale per row and expert: on the weights
            acc += (w.to(tl.float32) * s[:, None]) * a32[None, :]
        elif W_SCALE == 2:
            acc += w.to(tl.float32) * (a32 * s)[None, :]
        else:
            acc += w.to(tl.float32) * a32[None, :]
        a, w, s = a_next, w_next, s_next
    out = tl.sum(acc, 1)  # [BLOCK_N]
    if HAS_RES:
        out += tl.load(r_ptr + token * stride_rt + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + token * stride_ot + offs_n
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_n)


# ---- pair path, e4m3 experts: the one-row GEMV's vec layout -------------------------------------
#
# The kernels above widen an e4m3 tile with `.to(tl.float32)`, ~7-9 sm_90 instructions a weight
# (instruction-bound). These two take the one-row FP8 GEMV's scheme and helpers
# (`minisgl.kernels.gemv.gemv`): threads along the reduction, 16 e4m3 columns a thread and step
# kept as int32 words widened by inline PTX, x joined in registers into the same layout; 3.4-5.1
# instructions a weight (`test_pair_fp8_kernels_compile_for_sm90`).


@triton.jit
def _words4(t):
    """The four entries of the last axis of a 4-d t, as four 3-d tensors (register renames)."""
    even, odd = tl.split(tl.reshape(t, [t.shape[0], t.shape[1], t.shape[2], 2, 2]))
    t0, t2 = tl.split(even)
    t1, t3 = tl.split(odd)
    return t0, t1, t2, t3


@triton.jit
def _word_dots(d, w, x0, x1, x2, x3, WIDEN: tl.constexpr):
    """d + the four products of a word of e4m3 (byte j: column 4i + j) and x at those columns."""
    b0, b1, b2, b3 = _bytes(w, WIDEN)
    d += b0 * x0
    d += b1 * x1
    d += b2 * x2
    d += b3 * x3
    return d


@triton.jit
def _chunk_dots(
    d,  # [1, R, S] fp32: where each chain starts
    w,  # [1, R, S, 4] int32: each thread's 16 e4m3 columns of each row, as 4 words
    x, x2,  # [1, 1, S, 8] fp32: x at each thread's first 8 columns, and its last 8
    WIDEN: tl.constexpr,
):  # fmt: skip
    """d + each row's 16 products of a chunk, [1, R, S]: one FMA chain per row and chunk, one
    FMA a weight. x is joined in registers into the weights' layout and split by word and byte
    position (renames, no instructions)."""
    S: tl.constexpr = w.shape[2]
    xs = tl.reshape(tl.permute(tl.join(x, x2), [0, 1, 2, 4, 3]), [1, S, 4, 4])  # [1, S, i, j]
    xj0, xj1, xj2, xj3 = _words4(xs)  # x at byte j of every word: [1, S, 4 words]
    x00, x10, x20, x30 = _words4(tl.reshape(xj0, [1, 1, S, 4]))
    x01, x11, x21, x31 = _words4(tl.reshape(xj1, [1, 1, S, 4]))
    x02, x12, x22, x32 = _words4(tl.reshape(xj2, [1, 1, S, 4]))
    x03, x13, x23, x33 = _words4(tl.reshape(xj3, [1, 1, S, 4]))
    w0, w1, w2, w3 = _words4(w)
    d = _word_dots(d, w0, x00, x01, x02, x03, WIDEN)
    d = _word_dots(d, w1, x10, x11, x12, x13, WIDEN)
    d = _word_dots(d, w2, x20, x21, x22, x23, WIDEN)
    d = _word_dots(d, w3, x30, x31, x32, x33, WIDEN)
    return d


@triton.jit
def _along_chunks(rows, chunks):
    """rows [R] + chunks [S] as [1, R, S] offsets of a value per weight row and 16-column
    chunk (the scales), declared contiguous along the chunks (they are not), so the compiler
    lays the load's threads as the products' (along the chunks), not along the rows: no
    shared-memory round trip each step. (A hint holds only on a value computed in the function
    that gives it, hence the sum here.)"""
    offs = tl.max_contiguous(rows[:, None] + chunks[None, :], [1, 2])
    return offs[None]


@triton.jit
def _gate_up_fp8_loads(
    w_rows, words, m4, mask_r, row, s_expert, k0, hidden, stride_sn, W_SCALE: tl.constexpr,
    EVEN: tl.constexpr,
):  # fmt: skip
    """The gate/up weights of the step at column k0 ([1, R, S, 4] int32, 0 past H) and, for
    block scales, each row's and chunk's scale ([1, R, S]; else an unused [1, 1, 1]). EVEN:
    the step and the rows are whole, unmasked (no zeroing of masked-off registers)."""
    S: tl.constexpr = words.shape[2]
    if EVEN:
        w = tl.load(w_rows + k0 // 4, eviction_policy="evict_first")
    else:
        w = tl.load(w_rows + k0 // 4, mask=m4 & (k0 // 4 + words < hidden // 4), other=0,
                    eviction_policy="evict_first")  # fmt: skip
    if W_SCALE == 2:  # a chunk's 16 columns lie in one 128 x 128 block
        col = k0 + 16 * tl.arange(0, S)
        s_ptrs = s_expert + _along_chunks(row // 128 * stride_sn, col // 128)
        if EVEN:
            sb = tl.load(s_ptrs)
        else:
            sb = tl.load(s_ptrs, mask=mask_r[None, :, None] & (col < hidden)[None, None, :],
                         other=0.0)  # fmt: skip
    else:
        sb = tl.zeros([1, 1, 1], tl.float32)
    return w, sb


@triton.jit
def _gate_up_fp8_dots(acc, w, sb, x, x2, W_SCALE: tl.constexpr, WIDEN: tl.constexpr):
    """acc [1, R, S] plus a step's products: per-row scales wait for the end, so the FMA chains
    run on from the partial sums; block scales weigh each chunk's sum."""
    if W_SCALE == 2:
        acc += _chunk_dots(tl.zeros(acc.shape, tl.float32), w, x, x2, WIDEN) * sb
    else:
        acc = _chunk_dots(acc, w, x, x2, WIDEN)
    return acc


@triton.jit
def _pair_gate_up_fp8_kernel(
    # `_pair_gate_up_kernel`'s; x 16-bit with rows 16-byte aligned, w e4m3 with H % 16 == 0
    x_ptr, w_ptr, act_ptr, ids_ptr, weights_ptr, logits_ptr, norm_ptr, s_ptr, inter, hidden,
    num_experts, eps, stride_xt, stride_we, stride_wn, stride_at, stride_l, stride_se, stride_sn,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,  # columns of I: BLOCK_N gate rows and the BLOCK_N matching up rows
    BLOCK_K: tl.constexpr,  # columns of H a step; BLOCK_K // 16 >= 32 * num_warps on CUDA
    ROUTE: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr, NORM: tl.constexpr,
    W_SCALE: tl.constexpr,  # 1: per row, 2: per 128 x 128 block
    WIDEN: tl.constexpr,  # 0: byte extraction (the interpreter), 2: inline PTX (`_bytes`)
    AHEAD: tl.constexpr,  # a step's weights loaded during the previous step's products
    EVEN: tl.constexpr,  # not AHEAD, I % BLOCK_N == 0, H % BLOCK_K == 0: unmasked weights
    PDL: tl.constexpr,
):  # fmt: skip
    """`_pair_gate_up_kernel` for e4m3 experts: program (p, n)'s 2 x BLOCK_N weight rows (gate,
    then the matching up) are one [1, 2 * BLOCK_N, BLOCK_K // 16, 4] int32 tile a step."""
    pdl_prologue(PDL)
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    token = (pair // TOP_K).to(tl.int64)
    VEC: tl.constexpr = 16
    XV: tl.constexpr = 8  # columns of one 16-byte load of x
    S: tl.constexpr = BLOCK_K // VEC
    R: tl.constexpr = 2 * BLOCK_N
    # x does not depend on the routing: the first step's loads go out before it.
    x_row = x_ptr + token * stride_xt
    xk = (_steps_cols(S, XV) + (VEC - XV) * tl.arange(0, S)[:, None])[None, None]  # [1,1,S,XV]
    every = tl.full([1, 1, 1, 1], 1, tl.int1)
    x, x2, ss = _x_step(x_row, norm_ptr, s_ptr, xk, hidden, every, False, NORM, 0, 2, XV)
    expert = _pair_expert(ids_ptr, weights_ptr, logits_ptr, pair, token, pid_n, stride_l,
                          num_experts, TOP_K, ROUTE, BLOCK_TOPK, BLOCK_E,
                          RENORMALIZE).to(tl.int64)  # fmt: skip
    r = tl.arange(0, R)
    mask_r = pid_n * BLOCK_N + r % BLOCK_N < inter
    row = pid_n * BLOCK_N + r % BLOCK_N + (r // BLOCK_N) * inter  # gate rows, then up rows
    r4 = row[None, :, None, None]
    m4 = mask_r[None, :, None, None]
    words = _steps_cols(S, 4)[None, None]  # [1, 1, S, 4]: a thread's 16 columns as 4 words
    w_rows = (w_ptr.to(tl.pointer_type(tl.int32)) + expert * (stride_we // 4)
              + r4.to(tl.int64) * (stride_wn // 4) + words)  # fmt: skip
    s_expert = s_ptr + expert * stride_se
    acc = tl.zeros([1, R, S], tl.float32)
    if AHEAD:
        w, sb = _gate_up_fp8_loads(w_rows, words, m4, mask_r, row, s_expert, 0, hidden,
                                   stride_sn, W_SCALE, False)  # fmt: skip
        for k0 in range(0, hidden, BLOCK_K):
            # the next step's weights and x (all masked off after the last step)
            w_next, sb_next = _gate_up_fp8_loads(w_rows, words, m4, mask_r, row, s_expert,
                                                 k0 + BLOCK_K, hidden, stride_sn, W_SCALE,
                                                 False)  # fmt: skip
            acc = _gate_up_fp8_dots(acc, w, sb, x, x2, W_SCALE, WIDEN)
            x, x2, sq = _x_step(x_row, norm_ptr, s_ptr, xk + k0 + BLOCK_K, hidden, every, False,
                                NORM, 0, 2, XV)  # fmt: skip
            ss += sq
            w = w_next
            sb = sb_next
    else:
        # The first step ahead of the loop, on the x already loaded: at H <= BLOCK_K (Qwen3's
        # 2048 at 4 warps) the loop never runs, and no x past the last step is loaded.
        w, sb = _gate_up_fp8_loads(w_rows, words, m4, mask_r, row, s_expert, 0, hidden,
                                   stride_sn, W_SCALE, EVEN)  # fmt: skip
        acc = _gate_up_fp8_dots(acc, w, sb, x, x2, W_SCALE, WIDEN)
        for k0 in range(BLOCK_K, hidden, BLOCK_K):
            x, x2, sq = _x_step(x_row, norm_ptr, s_ptr, xk + k0, hidden, every, False, NORM, 0,
                                2, XV)  # fmt: skip
            ss += sq
            w, sb = _gate_up_fp8_loads(w_rows, words, m4, mask_r, row, s_expert, k0, hidden,
                                       stride_sn, W_SCALE, EVEN)  # fmt: skip
            acc = _gate_up_fp8_dots(acc, w, sb, x, x2, W_SCALE, WIDEN)
    y = tl.reshape(tl.sum(acc, 2), [R])
    if W_SCALE == 1:
        y = y * tl.load(s_expert + row, mask=mask_r, other=0.0)
    if NORM:
        y = y / tl.sqrt(tl.sum(tl.reshape(ss, [S]), 0) / hidden + eps)
    gate, up = tl.split(tl.permute(tl.reshape(y, [2, BLOCK_N]), [1, 0]))
    h = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = act_ptr + pair.to(tl.int64) * stride_at + offs_n
    tl.store(out_ptrs, h.to(act_ptr.dtype.element_ty), mask=offs_n < inter)


@triton.jit
def _pair_down_fp8_loads(
    act_ptr, ids_ptr, weights_ptr, s_ptr,
    w_rows,  # [1, BLOCK_N, 1, 1] int32 pointers to the program's rows of expert 0
    n4,  # [1, BLOCK_N, 1, 1] the output rows
    m_n4,  # n4 < H
    token, step, pieces, inter, stride_at, stride_we, stride_se, stride_sn,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, W_SCALE: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    """The operands of one step of the down kernel: (weights [1, BLOCK_N, S, 4] int32, the
    activations at each thread's first and last 8 columns [1, 1, S, 8] fp32, the scale of each
    row and chunk times the chunk's routing weight [1, BLOCK_N, S]). Chunk j of the token's
    TOP_K * I is columns [16 p, +16) of slot j // (I / 16)'s rows, p = j % (I / 16); past the
    last step nothing loads. EVEN (whole steps and rows): no masks, so no zeroing of masked-off
    registers (~5% of the loop's instructions)."""
    S: tl.constexpr = BLOCK_K // 16
    j = step * S + tl.arange(0, S)
    valid = j < TOP_K * pieces
    slot = j // pieces
    piece = j - slot * pieces
    pair = token * TOP_K + slot
    if EVEN:
        expert = tl.load(ids_ptr + pair)
        routing = tl.load(weights_ptr + pair)
    else:
        expert = tl.load(ids_ptr + pair, mask=valid, other=0)
        routing = tl.load(weights_ptr + pair, mask=valid, other=0.0)
    # Declared 16-byte aligned and, like `_steps_cols`, contiguous in pairs along S (they are
    # not; only the layout order comes from it: threads along S, each holding 4 words).
    col_w = tl.multiple_of(expert * (stride_we // 4) + piece * 4, 4)
    words = tl.max_contiguous(col_w[:, None] + tl.arange(0, 4)[None, :], [2, 4])[None, None]
    v4 = valid[None, None, :, None]
    cols = tl.max_contiguous(tl.multiple_of(piece * 16, 16)[:, None] + tl.arange(0, 8)[None, :],
                             [2, 8])[None, None]  # fmt: skip
    a_rows = (act_ptr + pair * stride_at)[None, None, :, None]
    if EVEN:
        w = tl.load(w_rows + words, eviction_policy="evict_first")
        a = tl.load(a_rows + cols).to(tl.float32)
        a2 = tl.load(a_rows + cols + 8).to(tl.float32)
    else:
        w = tl.load(w_rows + words, mask=m_n4 & v4, other=0, eviction_policy="evict_first")
        a, a2, _ = _x_step(a_rows, act_ptr, s_ptr, cols, inter, v4, False, False, 0, 2, 8)
    n = tl.reshape(n4, [n4.shape[1]])
    if W_SCALE == 1:
        s_offs = _along_chunks(n, expert * stride_se)
    else:  # a chunk's 16 columns lie in one 128 x 128 block
        s_offs = _along_chunks(n // 128 * stride_sn, expert * stride_se + piece // 8)
    if EVEN:
        s = tl.load(s_ptr + s_offs)
    else:
        s_mask = tl.reshape(m_n4, [1, n4.shape[1], 1]) & valid[None, None, :]
        s = tl.load(s_ptr + s_offs, mask=s_mask, other=0.0)
    return w, a, a2, s * routing[None, None, :]


@triton.jit
def _pair_down_fp8_kernel(
    # `_pair_down_kernel`'s; act 16-bit with rows 16-byte aligned, w e4m3 with I % 16 == 0
    act_ptr, w_ptr, out_ptr, ids_ptr, weights_ptr, r_ptr, s_ptr, hidden, inter, stride_at, stride_we, stride_wn, stride_ot, stride_rt, stride_se, stride_sn,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # chunk columns a step (of TOP_K * I); BLOCK_K // 16 >= 32 * warps
    HAS_RES: tl.constexpr, W_SCALE: tl.constexpr, WIDEN: tl.constexpr,
    AHEAD: tl.constexpr,  # a step's loads issued during the previous step's products
    EVEN: tl.constexpr,  # not AHEAD, H % BLOCK_N == 0, TOP_K * I a multiple of BLOCK_K: no masks
    PDL: tl.constexpr,
):  # fmt: skip
    """`_pair_down_kernel` for e4m3 experts. The reduction is the token's TOP_K experts' I
    columns end to end, TOP_K * I, in 16-column chunks (one per thread and step): at
    Qwen3-30B-A3B's I = 768 that is 3 steps of 128 threads with none masked, where a BLOCK_K
    over I would leave most threads idle. Each chunk's 16 products are summed in a thread's
    registers, then scaled by its row's scale times its routing weight."""
    pdl_prologue(PDL)
    # 32-bit offsets (`pair_down` checks that the stack and the activations fit): the address
    # arithmetic of every chunk in the loop is half the instructions of 64-bit.
    token = tl.program_id(0)
    pid_n = tl.program_id(1)
    S: tl.constexpr = BLOCK_K // 16
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n4 = offs_n[None, :, None, None]
    m_n4 = n4 < hidden
    w_rows = w_ptr.to(tl.pointer_type(tl.int32)) + n4 * (stride_wn // 4)
    pieces = inter // 16
    acc = tl.zeros([1, BLOCK_N, S], tl.float32)
    if AHEAD:
        w, a, a2, s = _pair_down_fp8_loads(
            act_ptr, ids_ptr, weights_ptr, s_ptr, w_rows, n4, m_n4, token, 0, pieces, inter,
            stride_at, stride_we, stride_se, stride_sn, TOP_K, BLOCK_K, W_SCALE, False,
        )  # fmt: skip
    for step in range(0, tl.cdiv(TOP_K * pieces, S)):
        if AHEAD:  # the next step's (nothing past the last)
            w_next, a_next, a2_next, s_next = _pair_down_fp8_loads(
                act_ptr, ids_ptr, weights_ptr, s_ptr, w_rows, n4, m_n4, token, step + 1, pieces,
                inter, stride_at, stride_we, stride_se, stride_sn, TOP_K, BLOCK_K, W_SCALE, False,
            )  # fmt: skip
        else:
            w, a, a2, s = _pair_down_fp8_loads(
                act_ptr, ids_ptr, weights_ptr, s_ptr, w_rows, n4, m_n4, token, step, pieces,
                inter, stride_at, stride_we, stride_se, stride_sn, TOP_K, BLOCK_K, W_SCALE, EVEN,
            )  # fmt: skip
        acc += _chunk_dots(tl.zeros([1, BLOCK_N, S], tl.float32), w, a, a2, WIDEN) * s
        if AHEAD:
            w, a, a2, s = w_next, a_next, a2_next, s_next
    out = tl.reshape(tl.sum(acc, 2), [BLOCK_N])
    mask_n = offs_n < hidden
    if HAS_RES:
        r_row = r_ptr + token.to(tl.int64) * stride_rt
        out += tl.load(r_row + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    out_row = out_ptr + token.to(tl.int64) * stride_ot
    tl.store(out_row + offs_n, out.to(out_ptr.dtype.element_ty), mask=mask_n)


class PairRouting(NamedTuple):
    """Each (token, k) pair's expert and routing weight, flattened: pair t * K + k."""

    ids: torch.Tensor  # [T * K] int32
    weights: torch.Tensor  # [T * K] fp32


def pair_fp8_supported(act: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the vec-layout kernels take these activations (x for gate/up, act for down) and
    expert stack: e4m3 experts whose rows are whole 16-byte loads (the reduction a multiple of
    16, contiguous), 16-bit activations whose rows start 16 bytes apart."""
    return act.stride(1) == 1 and _fp8_vec_fits(act.dtype, act.stride(0), w)


def _fp8_vec_fits(dtype: torch.dtype, row_stride: int, w: torch.Tensor) -> bool:
    return (
        w.dtype == torch.float8_e4m3fn
        and dtype in (torch.bfloat16, torch.float16)
        and row_stride % 8 == 0
        and w.shape[2] % 16 == 0
        and w.stride(2) == 1 and w.stride(1) % 16 == 0 and w.stride(0) % 16 == 0
    )  # fmt: skip


def _vec_args(tile: VecTile, kernel: object, device: torch.device) -> dict[str, int | bool]:
    """BLOCK_N, BLOCK_K, WIDEN and num_warps of a vec-layout kernel's launch. On the GPU every
    thread must own whole 16-column pieces of a step, no two threads the same ones (the
    interpreter has no threads, and runs the byte-extracting widen in place of the PTX)."""
    assert tile.widen in WIDEN and tile.block_k % 16 == 0, tile
    assert device.type != "cuda" or tile.block_k // 16 >= 32 * tile.num_warps, "BLOCK_K too small"
    widen = 0 if is_interpreted(kernel) else WIDEN[tile.widen]
    return dict(BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, WIDEN=widen, AHEAD=tile.ahead,
                num_warps=tile.num_warps)  # fmt: skip


def pair_gate_up(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    top_k: int,
    tile: GemmTile | VecTile,  # a VecTile: the e4m3 kernel (`pair_fp8_supported`)
    routing: PairRouting | None = None,
    logits: torch.Tensor | None = None,  # [T, E]
    renormalize: bool = False,
    norm_weight: torch.Tensor | None = None,  # [H]: x is RMS-normalised and scaled by it first
    eps: float = 1e-6,
    scale: torch.Tensor | None = None,  # e4m3 w13: ExpertScales.w13
) -> tuple[torch.Tensor, PairRouting]:  # act [T * K, I]
    """silu(gate) * up of every pair. Given `logits` instead of `routing`, the kernel routes
    the tokens too and returns the routing it chose."""
    assert norm_weight is None or norm_weight.shape == (x.shape[1],)
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    w_scale, s, stride_se, stride_sn = expert_scale_args(w13, scale)
    vec = isinstance(tile, VecTile)
    assert not vec or pair_fp8_supported(x, w13), "the vec-layout kernel takes e4m3 experts"
    if w_scale == 2 and not vec:  # a program's gate and up rows must each lie in one block row
        assert inter % 128 == 0 and 128 % tile.block_n == 0
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    route = routing is None
    if routing is None:
        if logits is None:
            raise ValueError("pair_gate_up needs either routing or router logits")
        routing = PairRouting(
            torch.empty(num_tokens * top_k, dtype=torch.int32, device=x.device),
            torch.empty(num_tokens * top_k, dtype=torch.float32, device=x.device),
        )
    src = logits if logits is not None and route else routing.weights  # unread unless ROUTE
    grid = (num_tokens * top_k, triton.cdiv(inter, tile.block_n))
    norm = norm_weight if norm_weight is not None else x
    flags = dict(TOP_K=top_k, ROUTE=route, BLOCK_TOPK=_topk_block(top_k),
                 BLOCK_E=triton.next_power_of_2(num_experts), RENORMALIZE=renormalize,
                 NORM=norm_weight is not None, W_SCALE=w_scale, **pdl_args(x.device))  # fmt: skip
    if isinstance(tile, VecTile):
        _pair_gate_up_fp8_kernel[grid](
            x, w13, act, routing.ids, routing.weights, src, norm, s, inter, hidden, num_experts,
            eps, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), src.stride(0),
            stride_se, stride_sn, EVEN=not tile.ahead and inter % tile.block_n == 0
            and hidden % tile.block_k == 0,
            **_vec_args(tile, _pair_gate_up_fp8_kernel, x.device), **flags,
        )  # fmt: skip
        return act, routing
    _pair_gate_up_kernel[grid](
        x, w13, act, routing.ids, routing.weights, src, norm, s, inter, hidden, num_experts, eps,
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), act.stride(0), src.stride(0),
        stride_se, stride_sn, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **flags,
    )  # fmt: skip
    return act, routing


def pair_down(
    act: torch.Tensor,  # [T * K, I]
    w2: torch.Tensor,  # [E, H, I]
    routing: PairRouting,
    top_k: int,
    tile: GemmTile | VecTile,  # a VecTile: the e4m3 kernel (`pair_fp8_supported`)
    residual: torch.Tensor | None = None,  # [T, H] added to the result
    scale: torch.Tensor | None = None,  # e4m3 w2: ExpertScales.w2
) -> torch.Tensor:  # [T, H]
    """sum_k weight_k * down_{expert_k}(act of pair (t, k)) for every token t (+ residual)."""
    num_tokens = act.shape[0] // top_k
    hidden, inter = w2.shape[1], w2.shape[2]
    assert residual is None or (residual.shape == (num_tokens, hidden) and residual.stride(1) == 1)
    w_scale, s, stride_se, stride_sn = expert_scale_args(w2, scale)
    vec = isinstance(tile, VecTile)
    assert not vec or pair_fp8_supported(act, w2), "the vec-layout kernel takes e4m3 experts"
    assert vec or w_scale != 2 or 128 % tile.block_n == 0, "a program's rows in one block row"
    out = torch.empty(num_tokens, hidden, dtype=act.dtype, device=act.device)
    res = residual if residual is not None else out
    grid = (num_tokens, triton.cdiv(hidden, tile.block_n))
    args = (act, w2, out, routing.ids, routing.weights, res, s, hidden, inter, act.stride(0),
            w2.stride(0), w2.stride(1))  # fmt: skip
    flags = dict(TOP_K=top_k, HAS_RES=residual is not None, W_SCALE=w_scale, **pdl_args(act.device))
    if isinstance(tile, VecTile):
        assert w2.numel() < 2**31 and act.numel() < 2**31, "32-bit offsets"
        even = hidden % tile.block_n == 0 and top_k * inter % tile.block_k == 0
        _pair_down_fp8_kernel[grid](
            *args, out.stride(0), res.stride(0), stride_se, stride_sn, EVEN=even and not tile.ahead,
            **_vec_args(tile, _pair_down_fp8_kernel, act.device), **flags,
        )  # fmt: skip
        return out
    _pair_down_kernel[grid](
        *args, w2.stride(2), out.stride(0), res.stride(0), stride_se, stride_sn,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, BLOCK_TOPK=_topk_block(top_k),
        num_warps=tile.num_warps, num_stages=tile.num_stages, **flags,
    )  # fmt: skip
    return out


def pair_tiles(
    config: PairConfig, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> tuple[GemmTile | VecTile, GemmTile | VecTile]:
    """The (gate/up, down) tiles of a pair-path call: the FP8 ones where the config has them
    and the experts are e4m3 that the vec-layout kernels take, else the [BLOCK_N, BLOCK_K] ones."""
    gate_up: GemmTile | VecTile = config.gate_up
    down: GemmTile | VecTile = config.down
    if config.fp8_gate_up is not None and pair_fp8_supported(x, w13):
        gate_up = config.fp8_gate_up
    # the activations: [T * K, I] contiguous in x's dtype
    if config.fp8_down is not None and _fp8_vec_fits(x.dtype, w2.shape[2], w2):
        down = config.fp8_down
    return gate_up, down
