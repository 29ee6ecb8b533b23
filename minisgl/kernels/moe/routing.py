"""MoE routing in Triton: top-k over the router logits (`fused_topk`), and the (token, k) pairs
sorted by expert and padded to blocks for the grouped GEMMs (`moe_align`)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from minisgl.kernels.common import pdl_args, pdl_prologue

# ---- 1. routing --------------------------------------------------------------------------------


@triton.jit
def _route(
    logits_ptr,  # [T, E]
    token, stride_l, num_experts, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr,
):  # fmt: skip
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
    stride_l, num_experts, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
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
    numel, NUM_EXPERTS: tl.constexpr, BINS: tl.constexpr, BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
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
