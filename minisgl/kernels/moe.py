"""Fused mixture-of-experts for CUDA (imports Triton).

A step runs five launches, none of which syncs with the host (CUDA-graph safe):

1. `fused_topk`: softmax over the router logits, the top k experts of each token, renormalised.
2. `moe_align`: the T*K (token, expert) pairs sorted by expert, each expert's run padded to a
   multiple of BLOCK_M, so every block of BLOCK_M rows belongs to one expert.
3. gate/up grouped GEMM: each program multiplies one block of gathered token rows by a
   BLOCK_N-column slice of its expert's gate and up weights and writes silu(gate) * up.
4. down grouped GEMM: the activations by the expert's down weights, times the routing weight,
   written to the row of each (token, k) pair.
5. a sum over the k rows of each token.

The math is `minisgl.layers.moe.moe_reference`; `align_reference` here is the torch
specification of step 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# ---- tile configurations -----------------------------------------------------------------------


@dataclass(frozen=True)
class GemmTile:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class FusedMoEConfig:
    """Tiles of the two grouped GEMMs; both walk the same BLOCK_M-row expert blocks."""

    block_m: int
    gate_up: GemmTile
    down: GemmTile


# By rows per expert (T * K / E), smallest first: the first bucket whose bound is >= the
# rows per expert wins. Decode sizes are memory-bound (narrow N tiles spread each expert's
# weights over many SMs); prefill sizes are compute-bound (wide tiles reuse each weight tile).
# Starting points for an H200 at the Qwen3-30B-A3B shape; `python -m minisgl.benchmark.moe
# --tune` measures the candidates on the GPU at hand.
DEFAULT_CONFIGS: tuple[tuple[float, FusedMoEConfig], ...] = (
    (4, FusedMoEConfig(16, GemmTile(32, 256, 4, 3), GemmTile(64, 128, 4, 4))),
    (16, FusedMoEConfig(16, GemmTile(64, 128, 4, 4), GemmTile(64, 128, 4, 4))),
    (64, FusedMoEConfig(32, GemmTile(64, 128, 4, 3), GemmTile(128, 64, 4, 3))),
    (256, FusedMoEConfig(64, GemmTile(64, 64, 4, 3), GemmTile(128, 64, 4, 3))),
    (float("inf"), FusedMoEConfig(128, GemmTile(64, 64, 8, 3), GemmTile(128, 64, 8, 3))),
)


def default_config(num_tokens: int, top_k: int, num_experts: int) -> FusedMoEConfig:
    rows_per_expert = num_tokens * top_k / num_experts
    return next(cfg for bound, cfg in DEFAULT_CONFIGS if rows_per_expert <= bound)


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


# ---- 1. routing --------------------------------------------------------------------------------


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
):
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride_l + offs_e, mask=offs_e < num_experts, other=-float("inf"))
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
    tl.store(weights_ptr + t * TOP_K + offs_k, vals, mask=offs_k < TOP_K)
    tl.store(ids_ptr + t * TOP_K + offs_k, idxs, mask=offs_k < TOP_K)


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
        TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k),
        BLOCK_E=triton.next_power_of_2(num_experts), RENORMALIZE=renormalize,
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


@triton.jit
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
):
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


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2I, H]: gate rows [0, I), up rows [I, 2I)
    act_ptr,  # [max_blocks * BLOCK_M, I]: silu(gate) * up, in sorted order
    sorted_ids_ptr,
    block_expert_ptr,
    num_padded_ptr,
    numel,
    inter,  # I
    hidden,  # H
    stride_xt,
    stride_we,
    stride_wn,
    stride_wk,
    stride_at,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
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
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, tl.cdiv(hidden, BLOCK_K)):
        mask_k = offs_k < hidden - k * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
        w_mask = mask_k[:, None] & mask_n[None, :]
        g = tl.load(g_ptrs, mask=w_mask, other=0.0)
        u = tl.load(u_ptrs, mask=w_mask, other=0.0)
        acc_g = _dot(a, g, acc_g, IEEE, UPCAST)
        acc_u = _dot(a, u, acc_u, IEEE, UPCAST)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) * up; padding rows are 0
    out_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_at + offs_n[None, :]
    tl.store(out_ptrs, h.to(act_ptr.dtype.element_ty), mask=mask_n[None, :])


@triton.jit
def _down_kernel(
    act_ptr,  # [max_blocks * BLOCK_M, I] in sorted order
    w_ptr,  # [E, H, I]
    out_ptr,  # [T * K, H]: row t * K + k
    topk_weights_ptr,  # [T * K] fp32
    sorted_ids_ptr,
    block_expert_ptr,
    num_padded_ptr,
    numel,
    hidden,  # H (the output columns)
    inter,  # I (the reduction)
    stride_at,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, tl.cdiv(inter, BLOCK_K)):
        mask_k = offs_k < inter - k * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = _dot(a, w, acc, IEEE, UPCAST)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    routing = tl.load(topk_weights_ptr + pair, mask=valid, other=0.0)  # [BLOCK_M] fp32
    acc = acc * routing[:, None]
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


def gate_up_gemm(
    x: torch.Tensor, w13: torch.Tensor, rows: AlignedRows, top_k: int, tile: GemmTile
) -> torch.Tensor:  # [max_blocks * block_m, I]
    inter = w13.shape[1] // 2
    act = torch.empty(rows.sorted_ids.shape[0], inter, dtype=x.dtype, device=x.device)
    ieee, upcast = _flags(x.dtype, _gate_up_kernel)
    grid = (rows.max_blocks, triton.cdiv(inter, tile.block_n))
    _gate_up_kernel[grid](
        x, w13, act, rows.sorted_ids, rows.block_expert, rows.num_padded, x.shape[0] * top_k,
        inter, x.shape[1], x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2),
        act.stride(0), TOP_K=top_k, BLOCK_M=rows.block_m, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, IEEE=ieee, UPCAST=upcast, num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )  # fmt: skip
    return act


def down_gemm(
    act: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    rows: AlignedRows,
    tile: GemmTile,
) -> torch.Tensor:  # [T * K, H]
    numel = topk_weights.numel()
    hidden, inter = w2.shape[1], w2.shape[2]
    out = torch.empty(numel, hidden, dtype=act.dtype, device=act.device)
    ieee, upcast = _flags(act.dtype, _down_kernel)
    grid = (rows.max_blocks, triton.cdiv(hidden, tile.block_n))
    _down_kernel[grid](
        act, w2, out, topk_weights, rows.sorted_ids, rows.block_expert, rows.num_padded, numel,
        hidden, inter, act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0),
        BLOCK_M=rows.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, IEEE=ieee,
        UPCAST=upcast, num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip
    return out


# ---- the whole layer ---------------------------------------------------------------------------


def fused_experts(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] fp32
    topk_ids: torch.Tensor,  # [T, K] int32 or int64
    config: FusedMoEConfig | None = None,
) -> torch.Tensor:  # [T, H] in x.dtype
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) with two grouped GEMMs."""
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    if w13.shape[2] != x.shape[1] or w2.shape[1] != x.shape[1] or w13.shape[1] != 2 * w2.shape[2]:
        raise ValueError(
            f"expert shapes {tuple(w13.shape)}, {tuple(w2.shape)} do not fit x {tuple(x.shape)}"
        )
    if num_tokens == 0:
        return torch.zeros_like(x)
    cfg = config or default_config(num_tokens, top_k, num_experts)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    rows = moe_align(topk_ids.contiguous(), num_experts, cfg.block_m)
    act = gate_up_gemm(x, w13, rows, top_k, cfg.gate_up)
    out = down_gemm(act, w2, topk_weights.float().contiguous(), rows, cfg.down)
    return out.view(num_tokens, top_k, -1).sum(dim=1)


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
    config: FusedMoEConfig | None = None,
) -> torch.Tensor:  # [T, H]
    """The MoE layer after its router: top-k routing, then `fused_experts`."""
    weights, ids = fused_topk(router_logits, top_k, renormalize)
    return fused_experts(x, w13, w2, weights, ids, config)
