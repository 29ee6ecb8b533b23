"""The blocked MoE path's grouped GEMMs (weight-only: 16-bit activations, 16-bit or e4m3
experts): gate/up with SiLU-and-multiply, then down times the routing weight, on rows
`moe_align` sorted by expert."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.common import dot_flags, pdl_args, pdl_prologue
from minisgl.kernels.fp8 import expert_scale_args
from minisgl.kernels.moe.common import block_done, row_block_scales, sorted_block
from minisgl.kernels.moe.routing import AlignedRows
from minisgl.kernels.moe.tiles import GemmTile, _block_tile


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a [M, K] @ b [K, N] with fp32 accumulation (UPCAST: the interpreter's bf16, as
    `common.dot`'s EMULATE_BF16)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


# `numel` (tokens x top_k) changes every step: no variant per "% 16" (a JIT compile mid-serving).
@triton.jit(do_not_specialize=["numel"])
def _gate_up_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2I, H]: gate rows [0, I), up rows [I, 2I)
    act_ptr,  # [max_blocks * BLOCK_M, I]: silu(gate) * up, in sorted order
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    s_ptr,  # e4m3 w: [E, 2I] fp32 per row (W_SCALE 1), [E, 2I/128, H/128] per block (2)
    numel,
    inter, hidden,  # I, H
    stride_xt, stride_we, stride_wn, stride_wk, stride_at, stride_se, stride_sn,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, W_SCALE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    # Block m of the sorted pairs x columns [n * BLOCK_N, +BLOCK_N) of I. The grid runs m
    # fastest, so neighbouring programs share an expert's weight tile in L2.
    pid_m, pid_n, done = block_done(num_padded_ptr, BLOCK_M)
    if done:
        return
    rows, pair, valid, expert, token, offs_n, offs_k, mask_n = sorted_block(
        sorted_ids_ptr, block_expert_ptr, pid_m, pid_n, numel, inter, TOP_K, BLOCK_M, BLOCK_N,
        BLOCK_K)  # fmt: skip
    a_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    u_ptrs = g_ptrs + inter * stride_wn  # [BLOCK_K, BLOCK_N]
    s_expert = s_ptr + expert * stride_se
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, tl.cdiv(hidden, BLOCK_K)):
        mask_k = offs_k < hidden - k * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
        w_mask = mask_k[:, None] & mask_n[None, :]
        g = tl.load(g_ptrs, mask=w_mask, other=0.0)
        u = tl.load(u_ptrs, mask=w_mask, other=0.0)
        if W_SCALE != 0:  # e4m3 weights, widened exactly to the activations' type
            g = g.to(a.dtype)
            u = u.to(a.dtype)
        if W_SCALE == 2:  # BLOCK_K divides 128: one scale per column in this K step
            kb = k * BLOCK_K // 128
            sg = row_block_scales(s_expert, offs_n, kb, stride_sn, mask_n)
            su = row_block_scales(s_expert, inter + offs_n, kb, stride_sn, mask_n)
            zero = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc_g += _dot(a, g, zero, IEEE, UPCAST) * sg[None, :]
            acc_u += _dot(a, u, zero, IEEE, UPCAST) * su[None, :]
        else:
            acc_g = _dot(a, g, acc_g, IEEE, UPCAST)
            acc_u = _dot(a, u, acc_u, IEEE, UPCAST)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    if W_SCALE == 1:
        acc_g *= tl.load(s_expert + offs_n, mask=mask_n, other=0.0)[None, :]
        acc_u *= tl.load(s_expert + inter + offs_n, mask=mask_n, other=0.0)[None, :]
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) * up; padding rows are 0
    out_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_at + offs_n[None, :]
    tl.store(out_ptrs, h.to(act_ptr.dtype.element_ty), mask=mask_n[None, :])


# `numel` (tokens x top_k) changes every step: no variant per "% 16" (a JIT compile mid-serving).
@triton.jit(do_not_specialize=["numel"])
def _down_kernel(
    act_ptr,  # [max_blocks * BLOCK_M, I] in sorted order
    w_ptr,  # [E, H, I]
    out_ptr,  # [T * K, H]: row t * K + k
    topk_weights_ptr,  # [T * K] fp32
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    s_ptr,  # e4m3 w: [E, H] fp32 per row (W_SCALE 1), [E, H/128, I/128] per block (2)
    numel,
    hidden, inter,  # H (the output columns), I (the reduction)
    stride_at, stride_we, stride_wn, stride_wk, stride_ot, stride_se, stride_sn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr, W_SCALE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    pid_m, pid_n, done = block_done(num_padded_ptr, BLOCK_M)  # block m x columns n of H
    if done:
        return
    rows, pair, valid, expert, _, offs_n, offs_k, mask_n = sorted_block(
        sorted_ids_ptr, block_expert_ptr, pid_m, pid_n, numel, hidden, 1, BLOCK_M, BLOCK_N, BLOCK_K
    )
    a_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_at + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    s_expert = s_ptr + expert * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, tl.cdiv(inter, BLOCK_K)):
        mask_k = offs_k < inter - k * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if W_SCALE != 0:  # e4m3 weights, widened exactly to the activations' type
            w = w.to(a.dtype)
        if W_SCALE == 2:  # BLOCK_K divides 128: one scale per column in this K step
            sw = row_block_scales(s_expert, offs_n, k * BLOCK_K // 128, stride_sn, mask_n)
            acc += _dot(a, w, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), IEEE, UPCAST) * sw[None, :]
        else:
            acc = _dot(a, w, acc, IEEE, UPCAST)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    if W_SCALE == 1:
        acc *= tl.load(s_expert + offs_n, mask=mask_n, other=0.0)[None, :]
    routing = tl.load(topk_weights_ptr + pair, mask=valid, other=0.0)  # [BLOCK_M] fp32
    acc = acc * routing[:, None]
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


def _launch(
    kernel: object, dtype: torch.dtype, w: torch.Tensor, scale: torch.Tensor | None,
    tile: GemmTile, rows: AlignedRows,
) -> tuple[int, torch.Tensor, tuple[int, int], dict[str, int | bool]]:  # fmt: skip
    """(BLOCK_N, the scales' pointer and strides, the launch flags) of a grouped GEMM."""
    w_scale, s, stride_se, stride_sn = expert_scale_args(w, scale)
    tile = _block_tile(tile, w_scale)
    ieee, upcast = dot_flags(dtype, kernel)
    flags = dict(BLOCK_M=rows.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, IEEE=ieee,
                 UPCAST=upcast, W_SCALE=w_scale, num_warps=tile.num_warps,
                 num_stages=tile.num_stages, **pdl_args(w.device))  # fmt: skip
    return tile.block_n, s, (stride_se, stride_sn), flags


def gate_up_gemm(
    x: torch.Tensor,
    w13: torch.Tensor,
    rows: AlignedRows,
    top_k: int,
    tile: GemmTile,
    scale: torch.Tensor | None = None,  # e4m3 w13: ExpertScales.w13
) -> torch.Tensor:  # [max_blocks * block_m, I]
    inter = w13.shape[1] // 2
    block_n, s, scale_strides, flags = _launch(_gate_up_kernel, x.dtype, w13, scale, tile, rows)
    act = torch.empty(rows.sorted_ids.shape[0], inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(rows.max_blocks, triton.cdiv(inter, block_n))](
        x, w13, act, rows.sorted_ids, rows.block_expert, rows.num_padded, s,
        x.shape[0] * top_k, inter, x.shape[1], x.stride(0), w13.stride(0), w13.stride(1),
        w13.stride(2), act.stride(0), *scale_strides, TOP_K=top_k, **flags,
    )  # fmt: skip
    return act


def down_gemm(
    act: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    rows: AlignedRows,
    tile: GemmTile,
    scale: torch.Tensor | None = None,  # e4m3 w2: ExpertScales.w2
) -> torch.Tensor:  # [T * K, H]
    numel = topk_weights.numel()
    hidden, inter = w2.shape[1], w2.shape[2]
    block_n, s, scale_strides, flags = _launch(_down_kernel, act.dtype, w2, scale, tile, rows)
    out = torch.empty(numel, hidden, dtype=act.dtype, device=act.device)
    _down_kernel[(rows.max_blocks, triton.cdiv(hidden, block_n))](
        act, w2, out, topk_weights, rows.sorted_ids, rows.block_expert, rows.num_padded, s,
        numel, hidden, inter, act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2),
        out.stride(0), *scale_strides, **flags,
    )  # fmt: skip
    return out
