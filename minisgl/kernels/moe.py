"""Fused mixture-of-experts for CUDA (imports Triton).

Two paths, both without a host sync (CUDA-graph safe); the config table picks one by the rows
each expert gets on average (T * K / E):

Pair path, for a few tokens (decode at small batch), where the step is launch- and
latency-bound; two launches after the router GEMM:

1. `_pair_gate_up_kernel`: one program per (token, k) pair and BLOCK_N columns of I. It routes
   the token itself (softmax over the router logits, top-k, renormalise: the same math as
   `fused_topk`), multiplies the token's row by its expert's gate and up slices (a GEMV) and
   writes silu(gate) * up. No sort: each pair reads its own expert's weights (two pairs of
   different tokens on one expert read it twice, hence "a few tokens").
2. `_pair_down_kernel`: one program per token and BLOCK_N columns of H; it loops over the
   token's k experts and sums routing weight * down projection, writing the layer's output.

`one_row_moe` is the pair path for one token with the layer's surroundings folded in (batch-1
decode): the router as a one-row GEMV with the RMSNorm in its prologue, the gate/up kernel
normalising x itself, the down kernel adding the residual.

With e4m3 experts and 16-bit activations the pair path runs two other kernels of the same
contract (`_pair_gate_up_fp8_kernel`, `_pair_down_fp8_kernel`; `PairConfig.fp8_gate_up`,
`fp8_down`): the one-row FP8 GEMV's vec layout, where a thread widens 16 packed e4m3 weights of
a row per 16-byte load by inline PTX and meets x in its own registers (the comment above the
kernels says why); the down kernel reduces over the token's TOP_K experts' I columns end to end.

Blocked path, for everything larger; five launches:

1. `fused_topk`: softmax over the router logits, the top k experts of each token, renormalised.
2. `moe_align`: the T*K (token, expert) pairs sorted by expert, each expert's run padded to a
   multiple of BLOCK_M, so every block of BLOCK_M rows belongs to one expert.
3. gate/up grouped GEMM: each program multiplies one block of gathered token rows by a
   BLOCK_N-column slice of its expert's gate and up weights and writes silu(gate) * up.
4. down grouped GEMM: the activations by the expert's down weights, times the routing weight,
   written to the row of each (token, k) pair.
5. a sum over the k rows of each token.

The math is `minisgl.layers.moe.moe_reference`; `align_reference` here is the torch
specification of blocked step 2.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from minisgl.kernels import moe_fp8
from minisgl.kernels.common import (
    is_interpreted,
    pdl_args,
    pdl_prologue,
    row_block_scales,
    sorted_block,
)
from minisgl.kernels.fp8 import ExpertScales, expert_scale_args, expert_scale_kind
from minisgl.kernels.gemv import WIDEN, _block_scales, _bytes, _steps_cols, _x_step, gemv

# ---- tile configurations -----------------------------------------------------------------------


@dataclass(frozen=True)
class GemmTile:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class FusedMoEConfig:
    """The blocked path: tiles of the two grouped GEMMs; both walk the same BLOCK_M-row expert
    blocks."""

    block_m: int
    gate_up: GemmTile
    down: GemmTile


@dataclass(frozen=True)
class PairConfig:
    """The pair path: GEMV tiles ([BLOCK_N, BLOCK_K] of one expert's weights per loop step) of
    the per-pair gate/up kernel and the per-token down kernel. Their loads feed no tl.dot, so
    Triton does not pipeline them and num_stages has no effect: the kernels prefetch one step
    ahead by hand, and the loads in flight per SM grow with BLOCK_N * BLOCK_K and the number of
    programs (one per pair and BLOCK_N columns of I; one per token and BLOCK_N columns of H)."""

    gate_up: GemmTile
    down: GemmTile
    # e4m3 experts with 16-bit activations: the vec-layout kernels' tiles
    # (`_pair_gate_up_fp8_kernel`, `_pair_down_fp8_kernel`); None: the tiles above, on the
    # kernels that widen a [BLOCK_N, BLOCK_K] tile.
    fp8_gate_up: VecTile | None = None
    fp8_down: VecTile | None = None


@dataclass(frozen=True)
class VecTile:
    """A tile of the pair path's FP8 kernels, in the vec layout of the one-row GEMV
    (`minisgl.kernels.gemv`, its FP8 section): every thread and warp lies along the reduction;
    each thread owns 16 consecutive columns of each of its rows per step (one 16-byte load of
    e4m3, kept as four int32 words), so BLOCK_K // 16 >= 32 * num_warps on CUDA. BLOCK_N is a
    program's output rows (gate/up: BLOCK_N gate rows and the BLOCK_N matching up rows)."""

    block_n: int
    block_k: int = 2048
    num_warps: int = 4
    # e4m3 -> fp32 by "ptx" (inline PTX, the hardware conversion of each int32's two 16-bit
    # halves; CUDA only: the interpreter runs "cvt" instead) or "cvt" (byte extraction).
    widen: str = "ptx"
    # A step's weights (down: and activations, scales) loaded during the previous step's
    # products: more bytes in flight per program, for twice the registers. At one step (gate/up
    # at H <= BLOCK_K) it only costs registers.
    ahead: bool = True


MoEConfig = FusedMoEConfig | PairConfig

# The pair path's e4m3 tiles (gate/up, down) in DEFAULT_CONFIGS and ONE_ROW_CONFIG: the best of
# `python -m minisgl.benchmark.moe --tune-fp8 --tune-tokens 1` on the H200 (session 17,
# Qwen3-30B-A3B shape, one token): gate/up 11.3 us, down 5.2 us, the layer 19.2 us against 28.8
# with the best [BLOCK_N, BLOCK_K] tiles of the 16-bit kernels (gate/up 19.4, down 9.4). Gate/up
# 4 columns of I (8 weight rows) a one-warp program, 512 columns a step, the next step's loads
# in flight; down 2 rows a program, TOP_K * I = 6144 columns in 3 steps of 2048.
FP8_PAIR_TILES = (VecTile(4, 512, 1, ahead=True), VecTile(2, 2048, 4, ahead=False))

# Rows per expert (T * K / E) -> config: the first bound (in insertion order, ascending) that is
# >= the call's rows per expert wins; the last bound must be math.inf. At Qwen3-30B-A3B's
# E=128, K=8 one token is 0.0625 rows per expert and 16 tokens are 1. Decode sizes are
# memory-bound (narrow N tiles spread each expert's weights over many SMs); prefill sizes are
# compute-bound (wide tiles reuse each weight tile). Starting points for an H200 at the
# Qwen3-30B-A3B shape; `python -m minisgl.benchmark.moe --tune` measures the candidates on the
# GPU at hand and prints a dict in this form to paste here.
DEFAULT_CONFIGS: dict[float, MoEConfig] = {
    # `benchmark.moe --tune --tune-tokens 1,2,4,8,16` on an H200, Qwen3-30B-A3B shape (128
    # experts, top 8): 1 token 28.2 us per layer, 2: 48.7, 4: 82.5, 8: 129.1, 16: 199.8.
    # (FP8 tiles: `FP8_PAIR_TILES`, measured at one token.)
    0.0625: PairConfig(GemmTile(16, 256, 4, 1), GemmTile(8, 1024, 8, 1), *FP8_PAIR_TILES),
    0.125: PairConfig(GemmTile(16, 256, 4, 1), GemmTile(16, 1024, 4, 1), *FP8_PAIR_TILES),
    0.25: FusedMoEConfig(16, GemmTile(32, 128, 4, 4), GemmTile(64, 128, 4, 3)),
    0.5: FusedMoEConfig(16, GemmTile(32, 128, 4, 3), GemmTile(64, 128, 4, 4)),
    1: FusedMoEConfig(16, GemmTile(128, 128, 4, 3), GemmTile(64, 128, 4, 3)),
    4: FusedMoEConfig(16, GemmTile(32, 256, 4, 3), GemmTile(64, 128, 4, 4)),
    16: FusedMoEConfig(16, GemmTile(64, 128, 4, 4), GemmTile(64, 128, 4, 4)),
    64: FusedMoEConfig(32, GemmTile(64, 128, 4, 3), GemmTile(128, 64, 4, 3)),
    256: FusedMoEConfig(64, GemmTile(64, 64, 4, 3), GemmTile(128, 64, 4, 3)),
    math.inf: FusedMoEConfig(128, GemmTile(64, 64, 8, 3), GemmTile(128, 64, 8, 3)),
}

# `one_row_moe` (batch-1 decode, the norm and residual inside): any expert count.
# On an H200 at the Qwen3-30B-A3B shape (docs/benchmarks.md, fifth session): 31.1 us per layer
# with the router's GEMV (2 x 2048, 8 warps; `minisgl.kernels.gemv.TUNED`), 37.8 with the tiles
# of the pair path's DEFAULT_CONFIGS entry, 40.3 for the norm + router + pair kernels + add.
ONE_ROW_CONFIG = PairConfig(GemmTile(16, 128, 4, 1), GemmTile(8, 1024, 4, 1), *FP8_PAIR_TILES)


def default_config(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    table: dict[float, MoEConfig] | None = None,
) -> MoEConfig:
    rows_per_expert = num_tokens * top_k / num_experts
    configs = DEFAULT_CONFIGS if table is None else table
    return next(cfg for bound, cfg in configs.items() if rows_per_expert <= bound)


def _flags(dtype: torch.dtype, kernel: object) -> tuple[bool, bool]:
    """(IEEE, UPCAST) for the dots: exact fp32 products (no TF32) for fp32 inputs; Triton's
    CPU interpreter multiplies 16-bit operands wrongly, so there they are widened first."""
    upcast = dtype != torch.float32 and isinstance(kernel, InterpretedFunction)
    return dtype == torch.float32, upcast


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a [M, K] @ b [K, N] with fp32 accumulation."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


def _block_tile(tile: GemmTile, w_scale: int) -> GemmTile:
    """Block-scaled experts take one scale per K step: at most 128 columns deep."""
    if w_scale == 2 and tile.block_k > 128:
        return dataclasses.replace(tile, block_k=128)
    return tile


# ---- 1. routing --------------------------------------------------------------------------------


@triton.jit
def _route(
    logits_ptr,  # [T, E]
    token,
    stride_l,
    num_experts,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """(weights [BLOCK_K] fp32, ids [BLOCK_K] int32) of one token; slots past TOP_K are 0.
    Ties go to the lower expert id."""
    offs_e = tl.arange(0, BLOCK_E)
    x = tl.load(
        logits_ptr + token * stride_l + offs_e, mask=offs_e < num_experts, other=-float("inf")
    )
    x = x.to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)  # [BLOCK_E], 0 past num_experts
    p = tl.where(offs_e < num_experts, p, -1.0)
    offs_k = tl.arange(0, BLOCK_K)
    vals = tl.zeros([BLOCK_K], tl.float32)
    idxs = tl.zeros([BLOCK_K], tl.int32)
    for k in tl.static_range(TOP_K):  # k rounds of argmax: K is small
        best = tl.max(p, 0)
        arg = tl.argmax(p, 0)
        vals = tl.where(offs_k == k, best, vals)
        idxs = tl.where(offs_k == k, arg, idxs)
        p = tl.where(offs_e == arg, -1.0, p)
    if RENORMALIZE:
        vals = vals / tl.sum(vals, 0)
    return vals, idxs


@triton.jit
def _topk_kernel(
    logits_ptr,  # [T, E]
    weights_ptr,  # [T, K] fp32
    ids_ptr,  # [T, K] int32
    stride_l,
    num_experts,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    vals, idxs = _route(logits_ptr, t, stride_l, num_experts, TOP_K, BLOCK_K, BLOCK_E, RENORMALIZE)
    offs_k = tl.arange(0, BLOCK_K)
    tl.store(weights_ptr + t * TOP_K + offs_k, vals, mask=offs_k < TOP_K)
    tl.store(ids_ptr + t * TOP_K + offs_k, idxs, mask=offs_k < TOP_K)


def _topk_block(top_k: int) -> int:
    return max(2, triton.next_power_of_2(top_k))


def fused_topk(
    logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, K] fp32, ids [T, K] int32
    """`minisgl.layers.moe.select_experts` in one launch (one program per token)."""
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    _topk_kernel[(num_tokens,)](
        logits, weights, ids, logits.stride(0), num_experts,
        TOP_K=top_k, BLOCK_K=_topk_block(top_k),
        BLOCK_E=triton.next_power_of_2(num_experts), RENORMALIZE=renormalize,
        **pdl_args(logits.device),
    )  # fmt: skip
    return weights, ids


# ---- 2. sort and pad by expert -----------------------------------------------------------------


class AlignedRows(NamedTuple):
    """The flattened (token, k) pairs grouped by expert in blocks of `block_m` rows.

    Row r of block b (position b * block_m + r) holds the index t * K + k of a pair routed to
    expert `block_expert[b]`, or T * K for padding. Only the first `num_padded` positions are
    meaningful; the buffers are sized for the worst case so nothing waits on the device.
    """

    sorted_ids: torch.Tensor  # [max_blocks * block_m] int32
    block_expert: torch.Tensor  # [max_blocks] int32
    num_padded: torch.Tensor  # [1] int32: positions in use (a multiple of block_m)
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.block_expert.shape[0]


def max_blocks(numel: int, num_experts: int, block_m: int) -> int:
    """Blocks needed at worst: each expert with pairs wastes at most block_m - 1 rows."""
    return (numel + min(num_experts, numel) * (block_m - 1)) // block_m


# `numel` (tokens x top_k) changes every step: no variant per "% 16" (a JIT compile mid-serving).
@triton.jit(do_not_specialize=["numel"])
def _align_kernel(
    ids_ptr,  # [numel] expert of each (token, k) pair
    sorted_ids_ptr,  # [max_blocks * BLOCK_M] int32
    block_expert_ptr,  # [max_blocks] int32
    num_padded_ptr,  # [1] int32
    numel,
    NUM_EXPERTS: tl.constexpr,
    BINS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    # One program per expert. Each counts every expert's pairs (cheap next to the GEMMs) to find
    # where its run starts, then writes its own pairs in their original order, its padding and
    # its blocks' expert ids: one launch, no atomics, no memset.
    e = tl.program_id(0)
    bins = tl.arange(0, BINS)
    counts = tl.zeros([BINS], tl.int32)
    for start in range(0, numel, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < numel, other=NUM_EXPERTS)
        counts += tl.histogram(ids, BINS)
    padded = tl.where(bins < NUM_EXPERTS, tl.cdiv(counts, BLOCK_M) * BLOCK_M, 0)
    run_start = tl.sum(tl.where(bins < e, padded, 0), 0)
    count = tl.sum(tl.where(bins == e, counts, 0), 0)
    run_len = tl.cdiv(count, BLOCK_M) * BLOCK_M
    if e == 0:
        tl.store(num_padded_ptr, tl.sum(padded, 0))

    seen = tl.zeros([], tl.int32)
    for start in range(0, numel, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < numel, other=NUM_EXPERTS)
        hit = (ids == e).to(tl.int32)
        rank = seen + tl.cumsum(hit, 0) - 1
        tl.store(sorted_ids_ptr + run_start + rank, offs, mask=hit != 0)
        seen += tl.sum(hit, 0)

    pad = count + tl.arange(0, BLOCK_M)
    tl.store(sorted_ids_ptr + run_start + pad, numel, mask=pad < run_len)
    first_block = run_start // BLOCK_M
    end_block = (run_start + run_len) // BLOCK_M
    for b in range(first_block, end_block, CHUNK):
        offs = b + tl.arange(0, CHUNK)
        tl.store(block_expert_ptr + offs, e, mask=offs < end_block)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedRows:
    """topk_ids [T, K] -> the pairs sorted by expert and padded to blocks (one launch)."""
    numel = topk_ids.numel()
    dev = topk_ids.device
    n_blocks = max_blocks(numel, num_experts, block_m)
    sorted_ids = torch.empty(n_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    if numel == 0:
        num_padded = torch.zeros(1, dtype=torch.int32, device=dev)
        return AlignedRows(sorted_ids, block_expert, num_padded, block_m)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)  # program 0 writes it
    _align_kernel[(num_experts,)](
        topk_ids.to(torch.int32), sorted_ids, block_expert, num_padded, numel,
        NUM_EXPERTS=num_experts, BINS=triton.next_power_of_2(num_experts + 1), BLOCK_M=block_m,
        CHUNK=128 if numel <= 128 else 1024,  # two variants to compile, not one per batch size
        **pdl_args(dev),
    )  # fmt: skip
    return AlignedRows(sorted_ids, block_expert, num_padded, block_m)


def align_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedRows:
    """The specification of `moe_align` in torch ops (positions past num_padded left 0)."""
    flat = topk_ids.reshape(-1).long()  # [N]
    numel, dev = flat.numel(), flat.device
    n_blocks = max_blocks(numel, num_experts, block_m)
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    run_start = torch.cumsum(padded, 0) - padded  # [E]
    order = torch.argsort(flat, stable=True)  # [N] pairs grouped by expert, in original order
    experts = flat[order]
    rank = torch.arange(numel, device=dev) - (torch.cumsum(counts, 0) - counts)[experts]
    sorted_ids = torch.zeros(n_blocks * block_m, dtype=torch.int32, device=dev)
    total = int(padded.sum())
    sorted_ids[:total] = numel
    sorted_ids[run_start[experts] + rank] = order.int()
    block_expert = torch.zeros(n_blocks, dtype=torch.int32, device=dev)
    block_expert[: total // block_m] = torch.repeat_interleave(
        torch.arange(num_experts, device=dev, dtype=torch.int32), padded // block_m
    )
    num_padded = torch.tensor([total], dtype=torch.int32, device=dev)
    return AlignedRows(sorted_ids, block_expert, num_padded, block_m)


# ---- 3, 4. grouped GEMMs -----------------------------------------------------------------------


# `numel` (tokens x top_k) changes every step: no variant per "% 16" (a JIT compile mid-serving).
@triton.jit(do_not_specialize=["numel"])
def _gate_up_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2I, H]: gate rows [0, I), up rows [I, 2I)
    act_ptr,  # [max_blocks * BLOCK_M, I]: silu(gate) * up, in sorted order
    sorted_ids_ptr,
    block_expert_ptr,
    num_padded_ptr,
    s_ptr,  # e4m3 w: [E, 2I] fp32 per row (W_SCALE 1), [E, 2I/128, H/128] per block (2)
    numel,
    inter,  # I
    hidden,  # H
    stride_xt,
    stride_we,
    stride_wn,
    stride_wk,
    stride_at,
    stride_se,
    stride_sn,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    W_SCALE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    # Program (m, n): block m of the sorted pairs x columns [n * BLOCK_N, +BLOCK_N) of I. The
    # grid runs m fastest, so neighbouring programs share an expert's weight tile in L2.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows, pair, valid, expert = sorted_block(sorted_ids_ptr, block_expert_ptr, pid_m, numel,
                                             BLOCK_M)  # fmt: skip
    token = (pair // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < inter
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
    sorted_ids_ptr,
    block_expert_ptr,
    num_padded_ptr,
    s_ptr,  # e4m3 w: [E, H] fp32 per row (W_SCALE 1), [E, H/128, I/128] per block (2)
    numel,
    hidden,  # H (the output columns)
    inter,  # I (the reduction)
    stride_at,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ot,
    stride_se,
    stride_sn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    W_SCALE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows, pair, valid, expert = sorted_block(sorted_ids_ptr, block_expert_ptr, pid_m, numel,
                                             BLOCK_M)  # fmt: skip
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < hidden
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


def gate_up_gemm(
    x: torch.Tensor,
    w13: torch.Tensor,
    rows: AlignedRows,
    top_k: int,
    tile: GemmTile,
    scale: torch.Tensor | None = None,  # e4m3 w13: ExpertScales.w13
) -> torch.Tensor:  # [max_blocks * block_m, I]
    inter = w13.shape[1] // 2
    w_scale = expert_scale_kind(w13, scale)
    tile = _block_tile(tile, w_scale)
    act = torch.empty(rows.sorted_ids.shape[0], inter, dtype=x.dtype, device=x.device)
    s, stride_se, stride_sn = expert_scale_args(scale, act)
    ieee, upcast = _flags(x.dtype, _gate_up_kernel)
    grid = (rows.max_blocks, triton.cdiv(inter, tile.block_n))
    _gate_up_kernel[grid](
        x, w13, act, rows.sorted_ids, rows.block_expert, rows.num_padded, s,
        x.shape[0] * top_k, inter, x.shape[1], x.stride(0), w13.stride(0), w13.stride(1),
        w13.stride(2), act.stride(0), stride_se, stride_sn, TOP_K=top_k, BLOCK_M=rows.block_m,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, IEEE=ieee, UPCAST=upcast, W_SCALE=w_scale,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **pdl_args(x.device),
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
    w_scale = expert_scale_kind(w2, scale)
    tile = _block_tile(tile, w_scale)
    out = torch.empty(numel, hidden, dtype=act.dtype, device=act.device)
    s, stride_se, stride_sn = expert_scale_args(scale, out)
    ieee, upcast = _flags(act.dtype, _down_kernel)
    grid = (rows.max_blocks, triton.cdiv(hidden, tile.block_n))
    _down_kernel[grid](
        act, w2, out, topk_weights, rows.sorted_ids, rows.block_expert, rows.num_padded, s,
        numel, hidden, inter, act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2),
        out.stride(0), stride_se, stride_sn, BLOCK_M=rows.block_m, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, IEEE=ieee, UPCAST=upcast, W_SCALE=w_scale,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **pdl_args(act.device),
    )  # fmt: skip
    return out


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
    num_experts,
    eps,
    stride_xt,
    stride_we,
    stride_wn,
    stride_wk,
    stride_at,
    stride_l,
    stride_se,
    stride_sn,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROUTE: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    NORM: tl.constexpr,
    W_SCALE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    # Program (p, n): pair p = t * K + k x columns [n * BLOCK_N, +BLOCK_N) of I. With ROUTE every
    # program of token t routes t again (a few hundred cycles; cheaper than a launch) and the
    # n == 0 programs publish the result for the down kernel. The programs of one kernel run
    # the same code on the same logits, so they agree on every pair's expert.
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
    # Products summed per lane in fp32, reduced across the K lanes once at the end. Triton
    # pipelines only loads that feed a tl.dot, so the loop prefetches by hand: tile k + 1's
    # loads are in flight while tile k is multiplied (at k + 1 == n_k they are all masked off).
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    mask_k = offs_k < hidden
    a = tl.load(x_ptrs, mask=mask_k, other=0.0)
    g = tl.load(g_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
    u = tl.load(u_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
    sg = _block_scales(sg_row, offs_k, hidden, W_SCALE)
    su = _block_scales(su_row, offs_k, hidden, W_SCALE)
    # NORM: x is RMS-normalised on the way, as in the one-row GEMV (minisgl.kernels.gemv): sum
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
    k_tiles,
    inter,
    mask_n,
    stride_at,
    stride_we,
    stride_wk,
    s_rows,  # [BLOCK_N] pointers to expert 0's row scales (W_SCALE 1) or [1] to its block row
    stride_se,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
    W_SCALE: tl.constexpr,
):
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
    stride_at,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ot,
    stride_rt,
    stride_se,
    stride_sn,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
    HAS_RES: tl.constexpr,
    W_SCALE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    # Program (t, n): columns [n * BLOCK_N, +BLOCK_N) of token t's output, summed over its K
    # experts in registers (no atomics, no separate sum). One flat loop over (k, I tile) steps
    # with the next step's loads in flight during this one's products (see the gate/up kernel);
    # the token's experts and weights sit in registers, so no load waits on another.
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
# The kernels above widen a [BLOCK_N, BLOCK_K] e4m3 tile with `.to(tl.float32)`: compiled for
# sm_90 that is byte extraction, a conversion and shared-memory traffic, ~7-9 instructions a
# weight, and an H200 SM must take in ~16 e4m3 bytes a clock at the copy bandwidth while it
# issues 128 thread instructions a clock: instruction-bound (gate/up 15.8 us, down 10.5 us per
# Qwen3-30B-A3B layer, ~0.37 of the copy bandwidth). These two take the scheme of the one-row
# FP8 GEMV (`minisgl.kernels.gemv`, `_gemv_rows_kernel` at ROWS 1 with words and the PTX
# widen), whose helpers they call: every thread and warp lies along the reduction; each thread
# owns 16 consecutive columns of each of its weight rows per step (one 16-byte load of e4m3,
# kept packed as four int32 words, each widened by two hardware conversions of its 16-bit
# halves: 1.5 instructions a weight) and the same 16 columns of the activation row (two 16-byte
# loads of bf16 joined in registers), so nothing moves between threads in the loop; fp32 sums
# per thread, reduced across threads once at the end. Compiled for sm_90 at FP8_PAIR_TILES
# (`test_pair_fp8_kernels_compile_for_sm90`): a loop step of gate/up 3.4-4.1 instructions a
# weight (96-116 registers), of down ~5.1 (2 rows a program, 32 registers; 8 rows: ~4, but
# slower on the H200). Measured there (docs/benchmarks.md, seventeenth session): the
# Qwen3-30B-A3B layer's experts at one token 19.2 us against 28.8 with the kernels above.


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
    FMA a weight (`_step_sums` of the one-row GEMV sums a word's four products, then the words,
    then adds: a multiply and four adds more per chunk and row, which the down kernel's scales
    per chunk would pay every step). x is joined in registers into the weights' layout and
    split by word and byte position, as there: renames, no instructions."""
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
    chunk (the scales), declared contiguous along the chunks alone (in pairs; they are not):
    the compiler lays a load's threads along its most contiguous dim, and for the scales of
    consecutive rows that would be the rows, where each thread of the products holds all of
    its rows of its own chunks: a shared-memory round trip every step to meet them. (A hint
    holds only on a value computed in the function that gives it, hence the sum here.)"""
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
    x_ptr,  # [T, H] 16-bit, rows 16-byte aligned
    w_ptr,  # [E, 2I, H] e4m3: gate rows [0, I), up rows [I, 2I); H % 16 == 0
    act_ptr,  # [T * K, I]: silu(gate) * up of pair t * K + k
    ids_ptr,  # [T * K] int32: read, or written when ROUTE
    weights_ptr,  # [T * K] fp32: written when ROUTE
    logits_ptr,  # [T, E] router logits, read when ROUTE
    norm_ptr,  # [H] RMSNorm weight (NORM)
    s_ptr,  # [E, 2I] fp32 per row (W_SCALE 1), [E, cdiv(2I, 128), cdiv(H, 128)] per block (2)
    inter,  # I
    hidden,  # H
    num_experts,
    eps,
    stride_xt,
    stride_we,
    stride_wn,
    stride_at,
    stride_l,
    stride_se,
    stride_sn,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,  # columns of I: BLOCK_N gate rows and the BLOCK_N matching up rows
    BLOCK_K: tl.constexpr,  # columns of H a step; BLOCK_K // 16 >= 32 * num_warps on CUDA
    ROUTE: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    NORM: tl.constexpr,
    W_SCALE: tl.constexpr,  # 1: per row, 2: per 128 x 128 block
    WIDEN: tl.constexpr,  # 0: byte extraction (the interpreter), 2: inline PTX (`_bytes`)
    AHEAD: tl.constexpr,  # a step's weights loaded during the previous step's products
    EVEN: tl.constexpr,  # not AHEAD, I % BLOCK_N == 0, H % BLOCK_K == 0: unmasked weights
    PDL: tl.constexpr,
):
    """`_pair_gate_up_kernel` for e4m3 experts: program (p, n) is pair p = t * K + k x columns
    [n * BLOCK_N, +BLOCK_N) of I, its 2 x BLOCK_N weight rows (gate, then the matching up) one
    [1, 2 * BLOCK_N, BLOCK_K // 16, 4] int32 tile a step. Routing, NORM and the output are
    that kernel's. At Qwen3-30B-A3B's H = 2048 = BLOCK_K there is one step: all of a
    program's loads are in flight at once, and AHEAD (a second step's buffers) only costs
    registers; it is for larger H."""
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
    row and chunk times the chunk's routing weight [1, BLOCK_N, S]). Chunk j (16 columns)
    of the token's TOP_K * I is columns [16 p, +16) of the down rows of slot j // (I / 16),
    p = j % (I / 16): a step's chunks may span two experts, so no column is masked off unless
    the last step overruns TOP_K * I. Past the last step, nothing loads. EVEN (whole steps and
    BLOCK_N rows, no step past the last): no masks, so no zeroing of the registers that masked
    loads would leave (~5% of the loop's instructions at the Qwen3-30B-A3B shape)."""
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
    act_ptr,  # [T * K, I] 16-bit, rows 16-byte aligned
    w_ptr,  # [E, H, I] e4m3, I % 16 == 0
    out_ptr,  # [T, H]
    ids_ptr,  # [T * K] int32
    weights_ptr,  # [T * K] fp32
    r_ptr,  # [T, H] residual (HAS_RES)
    s_ptr,  # [E, H] fp32 per row (W_SCALE 1), [E, cdiv(H, 128), cdiv(I, 128)] per block (2)
    hidden,  # H (the output columns)
    inter,  # I (the reduction)
    stride_at,
    stride_we,
    stride_wn,
    stride_ot,
    stride_rt,
    stride_se,
    stride_sn,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # chunk columns a step (of TOP_K * I); BLOCK_K // 16 >= 32 * warps
    HAS_RES: tl.constexpr,
    W_SCALE: tl.constexpr,
    WIDEN: tl.constexpr,
    AHEAD: tl.constexpr,  # a step's loads issued during the previous step's products
    EVEN: tl.constexpr,  # not AHEAD, H % BLOCK_N == 0, TOP_K * I a multiple of BLOCK_K: no masks
    PDL: tl.constexpr,
):
    """`_pair_down_kernel` for e4m3 experts: program (t, n) is columns [n * BLOCK_N, +BLOCK_N)
    of token t's output. The reduction is the token's TOP_K experts' I columns end to end,
    TOP_K * I, in 16-column chunks (one per thread and step, `_pair_down_fp8_loads`): at
    Qwen3-30B-A3B's I = 768 that is 384 chunks, 3 steps of 128 threads with none masked, where
    a BLOCK_K over I (768 = 48 chunks of 16, not a multiple of 128 threads) would leave most
    threads idle or masked. Each chunk's 16 products are summed in a thread's registers, then
    scaled by its row's scale (per expert) times its routing weight, and added to the thread's
    partial sum of the row. With AHEAD the next step's loads are in flight during a step's
    products (two steps of registers, and a copy of each at the end of every step; without,
    the other resident programs hide the loads' latency)."""
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
    w_scale = expert_scale_kind(w13, scale)
    vec = isinstance(tile, VecTile)
    assert not vec or pair_fp8_supported(x, w13), "the vec-layout kernel takes e4m3 experts"
    if w_scale == 2 and not vec:  # a program's gate and up rows must each lie in one block row
        assert inter % 128 == 0 and 128 % tile.block_n == 0
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    s, stride_se, stride_sn = expert_scale_args(scale, act)
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
    w_scale = expert_scale_kind(w2, scale)
    vec = isinstance(tile, VecTile)
    assert not vec or pair_fp8_supported(act, w2), "the vec-layout kernel takes e4m3 experts"
    assert vec or w_scale != 2 or 128 % tile.block_n == 0, "a program's rows in one block row"
    out = torch.empty(num_tokens, hidden, dtype=act.dtype, device=act.device)
    res = residual if residual is not None else out
    s, stride_se, stride_sn = expert_scale_args(scale, out)
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


# ---- the whole layer ---------------------------------------------------------------------------


def _check_shapes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    if w13.shape[2] != x.shape[1] or w2.shape[1] != x.shape[1] or w13.shape[1] != 2 * w2.shape[2]:
        raise ValueError(
            f"expert shapes {tuple(w13.shape)}, {tuple(w2.shape)} do not fit x {tuple(x.shape)}"
        )


def fused_experts(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] fp32
    topk_ids: torch.Tensor,  # [T, K] int32 or int64
    config: MoEConfig | None = None,
    scales: ExpertScales | None = None,  # e4m3 experts
) -> torch.Tensor:  # [T, H] in x.dtype
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]), on the path `config` picks."""
    num_tokens, top_k = topk_ids.shape
    _check_shapes(x, w13, w2)
    if num_tokens == 0:
        return torch.zeros_like(x)
    cfg = config or default_config(num_tokens, top_k, w13.shape[0])
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    s13, s2 = scales if scales is not None else (None, None)
    ids = topk_ids.to(torch.int32).contiguous()
    weights = topk_weights.float().contiguous()
    if isinstance(cfg, PairConfig):
        routing = PairRouting(ids.view(-1), weights.view(-1))
        gate_up, down = pair_tiles(cfg, x, w13, w2)
        act, _ = pair_gate_up(x, w13, top_k, gate_up, routing=routing, scale=s13)
        return pair_down(act, w2, routing, top_k, down, scale=s2)
    if s13 is not None and s2 is not None and moe_fp8.use_w8a8(x, w13, cfg.block_m):
        # e4m3 activations too, on FP8 wgmma (`minisgl.kernels.moe_fp8`; MINISGL_MOE_W8A8=0: off)
        rows = moe_align(ids, w13.shape[0], moe_fp8.w8a8_block_m(cfg.block_m))
        out = moe_fp8.w8a8_experts(x, w13, w2, (s13, s2), weights, rows)
    else:
        rows = moe_align(ids, w13.shape[0], cfg.block_m)
        act = gate_up_gemm(x, w13, rows, top_k, cfg.gate_up, s13)
        out = down_gemm(act, w2, weights, rows, cfg.down, s2)
    return out.view(num_tokens, top_k, -1).sum(dim=1)


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
    config: MoEConfig | None = None,
    scales: ExpertScales | None = None,  # e4m3 experts
) -> torch.Tensor:  # [T, H]
    """The MoE layer after its router: top-k routing, then the experts. On the pair path the
    routing runs inside the gate/up kernel (two launches in all)."""
    num_tokens = x.shape[0]
    _check_shapes(x, w13, w2)
    if num_tokens == 0:
        return torch.zeros_like(x)
    cfg = config or default_config(num_tokens, top_k, w13.shape[0])
    if isinstance(cfg, PairConfig):
        x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
        s13, s2 = scales if scales is not None else (None, None)
        gate_up, down = pair_tiles(cfg, x, w13, w2)
        act, routing = pair_gate_up(x, w13, top_k, gate_up, logits=router_logits,
                                    renormalize=renormalize, scale=s13)  # fmt: skip
        return pair_down(act, w2, routing, top_k, down, scale=s2)
    weights, ids = fused_topk(router_logits, top_k, renormalize)
    return fused_experts(x, w13, w2, weights, ids, cfg, scales)


def one_row_moe(
    x: torch.Tensor,  # [1, H] the residual stream (not normalised)
    router: torch.Tensor,  # [E, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    top_k: int,
    renormalize: bool,
    norm_weight: torch.Tensor,  # [H] the RMSNorm before the layer
    eps: float,
    config: PairConfig | None = None,
    scales: ExpertScales | None = None,  # e4m3 experts
) -> torch.Tensor:  # [1, H]: x + MoE(rmsnorm(x))
    """A whole MoE layer for one token (batch-1 decode) in three launches, none of them a
    separate norm or add: the router as a one-row GEMV that normalises x on the way
    (`minisgl.kernels.gemv`); the pair gate/up kernel, which routes and normalises x itself;
    the pair down kernel, which adds the residual."""
    _check_shapes(x, w13, w2)
    assert x.shape[0] == 1 and router.shape == (w13.shape[0], x.shape[1])
    cfg = config or ONE_ROW_CONFIG
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    s13, s2 = scales if scales is not None else (None, None)
    logits = gemv(x, router, norm_weight=norm_weight, eps=eps)  # [1, E]
    gate_up, down = pair_tiles(cfg, x, w13, w2)
    act, routing = pair_gate_up(x, w13, top_k, gate_up, logits=logits,
                                renormalize=renormalize, norm_weight=norm_weight, eps=eps,
                                scale=s13)  # fmt: skip
    return pair_down(act, w2, routing, top_k, down, residual=x, scale=s2)
