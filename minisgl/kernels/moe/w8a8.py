"""The blocked MoE path with FP8 activations too (W8A8; imports Triton).

At decode batch 256 of Qwen3-30B-A3B an expert gets ~16 rows; on sm_90 an M=16 dot is
mma.sync, which has no e4m3 form. Hopper's wgmma multiplies e4m3 natively but its M side is 64
rows, so A and B are swapped: out^T [BLOCK_N, BLOCK_M] = W [BLOCK_N, BLOCK_K] @ A^T, the weights
on wgmma's M side, the gathered token rows on its N side, both K-major in shared memory.

Activations are quantized per token and 128-column group: each 128-column K step is one e4m3
dot from zero, added to the fp32 accumulator times the group's scale (and the weight block's),
which also bounds the reduced precision of Hopper's FP8 accumulator.

Launches after `fused_topk` and `moe_align`: `quantize_activations` (x -> e4m3 + [T, H/128]
scales); `_w8a8_gate_up_kernel` (silu(gate) * up; with BLOCK_N == 128 a program holds whole
groups of I and quantizes its output itself, else a separate `quantize_activations` follows);
`_w8a8_down_kernel` (times the routing weight, per (token, k) row); the sum over k.

On by default (H200, Qwen3-30B-A3B shape, decode batch 256: 16,041 tok/s against 10,964 with
bf16 experts; the weight-only path 1.05x): e4m3 experts on CUDA take it (`use_w8a8`) on rows
`moe_align` pads to `w8a8_block_m`; `MINISGL_MOE_W8A8=0` keeps the weight-only GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from minisgl.config import env
from minisgl.kernels.common import is_interpreted, pdl_args, pdl_prologue, round_e4m3
from minisgl.kernels.fp8 import expert_scale_args
from minisgl.kernels.fp8.gemm import quantize_activations
from minisgl.kernels.moe.common import block_done, row_block_scales, sorted_block
from minisgl.kernels.moe.tiles import GemmTile

if TYPE_CHECKING:
    from minisgl.kernels.moe.routing import AlignedRows

GROUP = 128  # columns per activation scale (and the weights' block size)
MAX_BLOCK_M = 64  # taller blocks (prefill) keep the weight-only path: tiles not sized for them
# The least BLOCK_M is `MINISGL_MOE_W8A8_BLOCK_M` (16 until 32 is measured: token rows are
# wgmma's N side, so a taller block costs no MMA work and reads each weight tile once).


@dataclass(frozen=True)
class W8A8Config:
    """The two kernels' tiles: block_n (weight rows per program) is wgmma's M side, a multiple of
    64; block_k must divide 128 (one activation scale per row and K step)."""

    gate_up: GemmTile
    down: GemmTile


# Tiles by the blocked path's BLOCK_M (up to MAX_BLOCK_M), for an H200 at the Qwen3-30B-A3B
# shape (`python -m minisgl.benchmark.tune w8a8`): gate/up at 128 columns quantizes in its
# epilogue; taller blocks take 8 warps (gate/up's two fp32 accumulators stay in registers).
W8A8_CONFIGS: dict[int, W8A8Config] = {
    16: W8A8Config(GemmTile(128, 128, 4, 4), GemmTile(64, 128, 4, 4)),
    32: W8A8Config(GemmTile(128, 128, 8, 4), GemmTile(64, 128, 4, 4)),
    64: W8A8Config(GemmTile(128, 128, 8, 3), GemmTile(128, 128, 8, 3)),
}


def w8a8_config(block_m: int) -> W8A8Config:
    """The tiles for the smallest table entry that is at least `block_m` rows."""
    return next(cfg for m, cfg in W8A8_CONFIGS.items() if block_m <= m)


def w8a8_block_m(block_m: int) -> int:
    """The W8A8 path's BLOCK_M for a call the table gives `block_m`: at least
    `MINISGL_MOE_W8A8_BLOCK_M` (read now)."""
    return min(max(block_m, env.MOE_W8A8_BLOCK_M.get()), MAX_BLOCK_M)


def use_w8a8(x: torch.Tensor, w13: torch.Tensor, block_m: int) -> bool:
    """Whether the blocked path takes the W8A8 kernels: switched on (`MINISGL_MOE_W8A8`, read
    now), e4m3 experts, decode-sized blocks, on CUDA (or in the CPU interpreter, for the tests)."""
    return (
        w13.dtype == torch.float8_e4m3fn
        and block_m <= MAX_BLOCK_M
        and (x.device.type == "cuda" or is_interpreted(_w8a8_gate_up_kernel))
        and env.MOE_W8A8.get()
    )


@triton.jit
def _dot_wt(w, a):
    """w [N, K] @ a [M, K]^T -> [N, M] fp32, from zero (the caller promotes it per K step).
    (Triton's CPU interpreter runs the same e4m3 dot, exactly: e4m3 products fit in fp32.)"""
    return tl.dot(w, tl.trans(a))


# `numel` (tokens x top_k) changes every step: no variant per "% 16" (a JIT compile mid-serving).
@triton.jit(do_not_specialize=["numel"])
def _w8a8_gate_up_kernel(
    xq_ptr,  # [T, H] e4m3
    xs_ptr,  # [T, cdiv(H, 128)] fp32
    w_ptr,  # [E, 2I, H] e4m3: gate rows [0, I), up rows [I, 2I)
    s_ptr,  # [E, 2I] fp32 per row (W_SCALE 1), [E, 2I/128, H/128] per block (2)
    act_ptr,  # [max_blocks * BLOCK_M, I] in sorted order: e4m3 (QUANT_OUT) or 16-bit
    acts_ptr,  # [max_blocks * BLOCK_M, cdiv(I, 128)] fp32 (QUANT_OUT)
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr, numel,
    inter, hidden,  # I, H
    stride_xt, stride_xst, stride_we, stride_wn, stride_at, stride_ast, stride_se, stride_sn,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    W_SCALE: tl.constexpr,
    QUANT_OUT: tl.constexpr,  # BLOCK_N == 128: quantize the output per 128-column group here
    EMULATE_FP8: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    # Block m of the sorted pairs x columns [n * BLOCK_N, +BLOCK_N) of I, as the transposed
    # tiles gate^T, up^T [BLOCK_N, BLOCK_M] (see the module docstring).
    pid_m, pid_n, done = block_done(num_padded_ptr, BLOCK_M)
    if done:
        return
    rows, pair, valid, expert, token, offs_n, offs_k, mask_n = sorted_block(
        sorted_ids_ptr, block_expert_ptr, pid_m, pid_n, numel, inter, TOP_K, BLOCK_M, BLOCK_N,
        BLOCK_K)  # fmt: skip
    # Both tiles K-contiguous, as FP8 wgmma wants them in shared memory.
    a_ptrs = xq_ptr + token[:, None] * stride_xt + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    g_ptrs = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + inter * stride_wn  # [BLOCK_N, BLOCK_K]
    xs_rows = xs_ptr + token * stride_xst  # [BLOCK_M]
    s_expert = s_ptr + expert * stride_se
    acc_g = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    # The activation scales are plain loads (Triton pipelines only a dot's operands): each
    # step's are loaded one step ahead, so their latency hides behind a step of wgmma.
    n_k = tl.cdiv(hidden, BLOCK_K)
    sa = tl.load(xs_rows, mask=valid, other=0.0)  # [BLOCK_M]
    for k in range(0, n_k):
        k_next = tl.minimum(k + 1, n_k - 1)  # (the last step loads its own again)
        sa_next = tl.load(xs_rows + k_next * BLOCK_K // 128, mask=valid, other=0.0)
        mask_k = offs_k < hidden - k * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
        w_mask = mask_n[:, None] & mask_k[None, :]
        g = tl.load(g_ptrs, mask=w_mask, other=0.0)
        u = tl.load(u_ptrs, mask=w_mask, other=0.0)
        if W_SCALE == 2:  # and the weight block's scale (the block column is the group)
            kg = k * BLOCK_K // 128
            sg = row_block_scales(s_expert, offs_n, kg, stride_sn, mask_n)
            su = row_block_scales(s_expert, inter + offs_n, kg, stride_sn, mask_n)
            acc_g += _dot_wt(g, a) * (sg[:, None] * sa[None, :])
            acc_u += _dot_wt(u, a) * (su[:, None] * sa[None, :])
        else:
            acc_g += _dot_wt(g, a) * sa[None, :]
            acc_u += _dot_wt(u, a) * sa[None, :]
        sa = sa_next
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if W_SCALE == 1:
        acc_g *= tl.load(s_expert + offs_n, mask=mask_n, other=0.0)[:, None]
        acc_u *= tl.load(s_expert + inter + offs_n, mask=mask_n, other=0.0)[:, None]
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) * up; 0 in padding rows, columns
    out_ptrs = act_ptr + rows.to(tl.int64)[None, :] * stride_at + offs_n[:, None]
    if QUANT_OUT:
        # One group of 128 columns per program: each row's (column's here) amax / 448, then the
        # values divided by it and rounded to e4m3, as `quantize_activations` (IEEE divisions).
        amax = tl.max(tl.abs(h), 0)  # [BLOCK_M]
        scale = tl.math.div_rn(tl.maximum(amax, 1e-12), tl.full([BLOCK_M], 448.0, tl.float32))
        q = tl.math.div_rn(h, tl.zeros([BLOCK_N, BLOCK_M], tl.float32) + scale[None, :])
        q = tl.minimum(tl.maximum(q, -448.0), 448.0)
        if EMULATE_FP8:  # the interpreter's e4m3 cast rounds wrongly (see `quantize_fp8`)
            q = round_e4m3(q)
        tl.store(out_ptrs, q.to(act_ptr.dtype.element_ty), mask=mask_n[:, None])
        tl.store(acts_ptr + rows.to(tl.int64) * stride_ast + pid_n, scale)
    else:
        tl.store(out_ptrs, h.to(act_ptr.dtype.element_ty), mask=mask_n[:, None])


# `numel` (tokens x top_k) changes every step: no variant per "% 16" (a JIT compile mid-serving).
@triton.jit(do_not_specialize=["numel"])
def _w8a8_down_kernel(
    aq_ptr,  # [max_blocks * BLOCK_M, I] e4m3 in sorted order
    as_ptr,  # [max_blocks * BLOCK_M, cdiv(I, 128)] fp32
    w_ptr,  # [E, H, I] e4m3
    s_ptr,  # [E, H] fp32 per row (W_SCALE 1), [E, H/128, I/128] per block (2)
    out_ptr,  # [T * K, H]: row t * K + k
    topk_weights_ptr,  # [T * K] fp32
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr, numel,
    hidden, inter,  # H (the output columns), I (the reduction)
    stride_at, stride_ast, stride_we, stride_wn, stride_ot, stride_se, stride_sn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_SCALE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    # Block m of the sorted rows x columns [n * BLOCK_N, +BLOCK_N) of H, as out^T.
    pid_m, pid_n, done = block_done(num_padded_ptr, BLOCK_M)
    if done:
        return
    rows, pair, valid, expert, _, offs_n, offs_k, mask_n = sorted_block(
        sorted_ids_ptr, block_expert_ptr, pid_m, pid_n, numel, hidden, 1, BLOCK_M, BLOCK_N, BLOCK_K
    )
    a_ptrs = aq_ptr + rows.to(tl.int64)[:, None] * stride_at + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]
    as_rows = as_ptr + rows.to(tl.int64) * stride_ast  # [BLOCK_M]
    s_expert = s_ptr + expert * stride_se
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    n_k = tl.cdiv(inter, BLOCK_K)
    sa = tl.load(as_rows)  # [BLOCK_M], one step ahead as in the gate/up kernel
    for k in range(0, n_k):
        sa_next = tl.load(as_rows + tl.minimum(k + 1, n_k - 1) * BLOCK_K // 128)
        mask_k = offs_k < inter - k * BLOCK_K
        # Padding rows hold zeros (the gate/up kernel wrote them), so no row mask is needed.
        a = tl.load(a_ptrs, mask=mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        if W_SCALE == 2:
            kg = k * BLOCK_K // 128
            sw = row_block_scales(s_expert, offs_n, kg, stride_sn, mask_n)
            acc += _dot_wt(w, a) * (sw[:, None] * sa[None, :])
        else:
            acc += _dot_wt(w, a) * sa[None, :]
        sa = sa_next
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if W_SCALE == 1:
        acc *= tl.load(s_expert + offs_n, mask=mask_n, other=0.0)[:, None]
    routing = tl.load(topk_weights_ptr + pair, mask=valid, other=0.0)  # [BLOCK_M] fp32
    acc = acc * routing[None, :]
    out_ptrs = out_ptr + pair.to(tl.int64)[None, :] * stride_ot + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[None, :] & mask_n[:, None])


def _check_tile(tile: GemmTile) -> None:
    assert GROUP % tile.block_k == 0, "a K step must lie in one 128-column group"


def w8a8_gate_up(
    xq: torch.Tensor,  # [T, H] e4m3
    xs: torch.Tensor,  # [T, cdiv(H, 128)] fp32
    w13: torch.Tensor,  # [E, 2I, H] e4m3
    scale: torch.Tensor,  # ExpertScales.w13
    rows: AlignedRows,
    top_k: int,
    tile: GemmTile,
    out_dtype: torch.dtype = torch.bfloat16,  # of the activations when BLOCK_N != 128
) -> tuple[torch.Tensor, torch.Tensor]:  # e4m3 [max_blocks * block_m, I], fp32 [.., I/128]
    """silu(gate) * up of every sorted row, quantized per 128-column group."""
    inter, hidden = w13.shape[1] // 2, w13.shape[2]
    assert xq.dtype == torch.float8_e4m3fn and xq.stride(1) == 1 and xq.shape[1] == hidden
    assert xs.shape == (xq.shape[0], triton.cdiv(hidden, GROUP)) and xs.stride(1) == 1
    _check_tile(tile)
    w_scale, _, stride_se, stride_sn = expert_scale_args(w13, scale)
    n_rows, groups = rows.sorted_ids.shape[0], triton.cdiv(inter, GROUP)
    fused = tile.block_n == GROUP  # a program holds exactly one group of I: quantize in place
    dev = xq.device
    act = torch.empty(n_rows, inter, dtype=torch.float8_e4m3fn if fused else out_dtype, device=dev)
    acts = torch.empty(n_rows, groups, dtype=torch.float32, device=dev)
    grid = (rows.max_blocks, triton.cdiv(inter, tile.block_n))
    _w8a8_gate_up_kernel[grid](
        xq, xs, w13, scale, act, acts, rows.sorted_ids, rows.block_expert, rows.num_padded,
        xq.shape[0] * top_k, inter, hidden, xq.stride(0), xs.stride(0), w13.stride(0),
        w13.stride(1), act.stride(0), acts.stride(0), stride_se, stride_sn, TOP_K=top_k,
        BLOCK_M=rows.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, W_SCALE=w_scale,
        QUANT_OUT=fused, EMULATE_FP8=is_interpreted(_w8a8_gate_up_kernel),
        num_warps=tile.num_warps, num_stages=tile.num_stages, **pdl_args(dev),
    )  # fmt: skip
    if fused:
        return act, acts
    # A 128-column group spans several programs: a separate launch quantizes the rows (all of
    # the buffer's rows; those past num_padded are never read).
    return quantize_activations(act, GROUP)


def w8a8_down(
    aq: torch.Tensor,  # [max_blocks * block_m, I] e4m3
    a_scale: torch.Tensor,  # [max_blocks * block_m, cdiv(I, 128)] fp32
    w2: torch.Tensor,  # [E, H, I] e4m3
    scale: torch.Tensor,  # ExpertScales.w2
    topk_weights: torch.Tensor,  # [T, K] fp32
    rows: AlignedRows,
    tile: GemmTile,
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [T * K, H]
    numel = topk_weights.numel()
    hidden, inter = w2.shape[1], w2.shape[2]
    assert aq.shape == (rows.sorted_ids.shape[0], inter) and aq.stride(1) == 1
    assert a_scale.shape == (aq.shape[0], triton.cdiv(inter, GROUP)) and a_scale.stride(1) == 1
    _check_tile(tile)
    w_scale, _, stride_se, stride_sn = expert_scale_args(w2, scale)
    out = torch.empty(numel, hidden, dtype=out_dtype, device=aq.device)
    grid = (rows.max_blocks, triton.cdiv(hidden, tile.block_n))
    _w8a8_down_kernel[grid](
        aq, a_scale, w2, scale, out, topk_weights, rows.sorted_ids, rows.block_expert,
        rows.num_padded, numel, hidden, inter, aq.stride(0), a_scale.stride(0), w2.stride(0),
        w2.stride(1), out.stride(0), stride_se, stride_sn,
        BLOCK_M=rows.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, W_SCALE=w_scale,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **pdl_args(aq.device),
    )  # fmt: skip
    return out


def w8a8_experts(
    x: torch.Tensor,  # [T, H] 16-bit, contiguous
    w13: torch.Tensor,  # [E, 2I, H] e4m3
    w2: torch.Tensor,  # [E, H, I] e4m3
    scales: tuple[torch.Tensor, torch.Tensor],  # ExpertScales
    topk_weights: torch.Tensor,  # [T, K] fp32 contiguous
    rows: AlignedRows,
    config: W8A8Config | None = None,
) -> torch.Tensor:  # [T * K, H] in x.dtype: each (token, k) row, routing weight applied
    """Steps 1-3 of the module docstring on rows `moe_align` sorted."""
    cfg = config or w8a8_config(rows.block_m)
    top_k = topk_weights.shape[1]
    xq, xs = quantize_activations(x, GROUP)
    aq, a_scale = w8a8_gate_up(xq, xs, w13, scales[0], rows, top_k, cfg.gate_up, x.dtype)
    return w8a8_down(aq, a_scale, w2, scales[1], topk_weights, rows, cfg.down, x.dtype)
