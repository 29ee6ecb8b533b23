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
from minisgl.kernels.common import pdl_args, pdl_prologue
from minisgl.kernels.fp8 import ExpertScales
from minisgl.kernels.gemv import _block_scales, gemv

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


MoEConfig = FusedMoEConfig | PairConfig

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
    0.0625: PairConfig(GemmTile(16, 256, 4, 1), GemmTile(8, 1024, 8, 1)),
    0.125: PairConfig(GemmTile(16, 256, 4, 1), GemmTile(16, 1024, 4, 1)),
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
ONE_ROW_CONFIG = PairConfig(GemmTile(16, 128, 4, 1), GemmTile(8, 1024, 4, 1))


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


def _weight_scale(w: torch.Tensor, scale: torch.Tensor | None) -> int:
    """W_SCALE of the kernels: 0 for 16/32-bit experts, 1 per row, 2 per 128 x 128 block."""
    fp8 = w.dtype == torch.float8_e4m3fn
    assert fp8 == (scale is not None), "e4m3 experts need their scales (and only they)"
    if scale is None:
        return 0
    assert scale.dtype == torch.float32 and scale.is_contiguous()
    e, n, k = w.shape
    if scale.dim() == 2:
        assert scale.shape == (e, n)
        return 1
    assert scale.shape == (e, triton.cdiv(n, 128), triton.cdiv(k, 128))
    return 2


def _scale_args(
    scale: torch.Tensor | None, fallback: torch.Tensor
) -> tuple[torch.Tensor, int, int]:
    """(pointer, stride per expert, stride per block row) of a scale tensor (unread if None)."""
    if scale is None:
        return fallback, 0, 0
    return scale, scale.stride(0), scale.stride(1) if scale.dim() == 3 else 0


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
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + rows)
    valid = pair < numel
    token = (pair // TOP_K).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
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
            sg = tl.load(s_expert + (offs_n // 128) * stride_sn + kb, mask=mask_n, other=0.0)
            su = tl.load(
                s_expert + ((inter + offs_n) // 128) * stride_sn + kb, mask=mask_n, other=0.0
            )
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
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + rows)
    valid = pair < numel
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
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
            sw = tl.load(
                s_expert + (offs_n // 128) * stride_sn + k * BLOCK_K // 128, mask=mask_n, other=0.0
            )
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
    w_scale = _weight_scale(w13, scale)
    tile = _block_tile(tile, w_scale)
    act = torch.empty(rows.sorted_ids.shape[0], inter, dtype=x.dtype, device=x.device)
    s, stride_se, stride_sn = _scale_args(scale, act)
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
    w_scale = _weight_scale(w2, scale)
    tile = _block_tile(tile, w_scale)
    out = torch.empty(numel, hidden, dtype=act.dtype, device=act.device)
    s, stride_se, stride_sn = _scale_args(scale, out)
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


class PairRouting(NamedTuple):
    """Each (token, k) pair's expert and routing weight, flattened: pair t * K + k."""

    ids: torch.Tensor  # [T * K] int32
    weights: torch.Tensor  # [T * K] fp32


def pair_gate_up(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    top_k: int,
    tile: GemmTile,
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
    w_scale = _weight_scale(w13, scale)
    if w_scale == 2:  # a program's gate and up rows must each lie in one 128-row block
        assert inter % 128 == 0 and 128 % tile.block_n == 0
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    s, stride_se, stride_sn = _scale_args(scale, act)
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
    _pair_gate_up_kernel[grid](
        x, w13, act, routing.ids, routing.weights, src,
        norm_weight if norm_weight is not None else x, s, inter, hidden, num_experts, eps,
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), act.stride(0), src.stride(0),
        stride_se, stride_sn, TOP_K=top_k, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        ROUTE=route, BLOCK_TOPK=_topk_block(top_k), BLOCK_E=triton.next_power_of_2(num_experts),
        RENORMALIZE=renormalize, NORM=norm_weight is not None, W_SCALE=w_scale,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **pdl_args(x.device),
    )  # fmt: skip
    return act, routing


def pair_down(
    act: torch.Tensor,  # [T * K, I]
    w2: torch.Tensor,  # [E, H, I]
    routing: PairRouting,
    top_k: int,
    tile: GemmTile,
    residual: torch.Tensor | None = None,  # [T, H] added to the result
    scale: torch.Tensor | None = None,  # e4m3 w2: ExpertScales.w2
) -> torch.Tensor:  # [T, H]
    """sum_k weight_k * down_{expert_k}(act of pair (t, k)) for every token t (+ residual)."""
    num_tokens = act.shape[0] // top_k
    hidden, inter = w2.shape[1], w2.shape[2]
    assert residual is None or (residual.shape == (num_tokens, hidden) and residual.stride(1) == 1)
    w_scale = _weight_scale(w2, scale)
    assert w_scale != 2 or 128 % tile.block_n == 0, "a program's rows must lie in one block row"
    out = torch.empty(num_tokens, hidden, dtype=act.dtype, device=act.device)
    res = residual if residual is not None else out
    s, stride_se, stride_sn = _scale_args(scale, out)
    grid = (num_tokens, triton.cdiv(hidden, tile.block_n))
    _pair_down_kernel[grid](
        act, w2, out, routing.ids, routing.weights, res, s, hidden, inter, act.stride(0),
        w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0), res.stride(0), stride_se,
        stride_sn, TOP_K=top_k, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        BLOCK_TOPK=_topk_block(top_k), HAS_RES=residual is not None, W_SCALE=w_scale,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **pdl_args(act.device),
    )  # fmt: skip
    return out


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
        act, _ = pair_gate_up(x, w13, top_k, cfg.gate_up, routing=routing, scale=s13)
        return pair_down(act, w2, routing, top_k, cfg.down, scale=s2)
    if s13 is not None and s2 is not None and moe_fp8.use_w8a8(x, w13, cfg.block_m):
        # e4m3 activations too, on FP8 wgmma (`minisgl.kernels.moe_fp8`; off by default)
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
        act, routing = pair_gate_up(x, w13, top_k, cfg.gate_up, logits=router_logits,
                                    renormalize=renormalize, scale=s13)  # fmt: skip
        return pair_down(act, w2, routing, top_k, cfg.down, scale=s2)
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
    act, routing = pair_gate_up(x, w13, top_k, cfg.gate_up, logits=logits,
                                renormalize=renormalize, norm_weight=norm_weight, eps=eps,
                                scale=s13)  # fmt: skip
    return pair_down(act, w2, routing, top_k, cfg.down, residual=x, scale=s2)
