"""Paged attention of a mixed step in one launch whose grid depends only on a capacity, so a
CUDA graph captured once per token bucket replays it for any mix of decode and prefill rows.

Request b's rows are `cu_extend[b] : cu_extend[b+1]` of q, at positions `seq_lens[b] - ext_b ..
seq_lens[b] - 1`, attending causally to each other and fully to the request's cached prefix
(their K/V are already stored). Tensors are sized by the capacity (Tp rows, Bmax requests):
requests past the step have no rows and rows past `cu_extend[Bmax]` are padding.

Grid: (KV heads, work items). A program reads its KV head once for the whole GQA group: its
tile's rows are (token, query head) pairs, GPAD = the group padded to a power of two. Each
program derives its item from `cu_extend` on the device (no host list, no planning launch):
- wide items (requests of more than TOK_N new tokens): q-blocks of TOK_W = ROWS_W / GPAD
  tokens, each request's last block first; unmasked keys before the block, causal diagonal, as
  `extend.py`;
- narrow items (decodes, short extends of up to TOK_N = ROWS_N / GPAD tokens): one tile of
  ROWS_N rows (`decode.py`'s shape) with the keys split `num_splits` ways (a host int fixed per
  capture); the last split to finish combines the partials, as `decode.py` does;
- the rest zero the padding rows and exit (`max_work_items` leaves at least one such program),
  so a replay leaves no stale or NaN rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minisgl.kernels.attention.common import (
    attend_keys,
    check_tile_sizes,
    combine_splits,
    fp8_operand,
    kv_split_len,
    normalize,
    paged_launch,
    softmax_init,
)
from minisgl.kernels.common import pdl_prologue, round_bf16, split_counters


@dataclass(frozen=True)
class MixedConfig:
    """Tuning knobs of `mixed_attention` (sweep them on the target GPU: `python -m
    minisgl.benchmark.tune mixed`). One kernel holds both tile shapes, so warps and stages are
    shared."""

    # The best by geometric mean of `benchmark.tune mixed` on an H200 (head_dim 128, GQA 2).
    rows_wide: int = 64  # (token, head) rows of a prefill q-block: 32 tokens at GQA group 2
    block_n: int = 64  # keys per step of a wide item
    block_n_narrow: int = 128  # keys per step of a narrow item (16 rows: a decode's tile)
    # sm_90, head_dim 128, GQA 2: 196-198 registers (FP8 K/V 252, fp32 255), two programs an SM.
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        check_tile_sizes(self, "rows_wide", "block_n", "block_n_narrow")


def default_mixed_config(head_dim: int, elem_size: int = 2) -> MixedConfig:
    if head_dim > 128 or head_dim * elem_size > 256:  # wide heads, fp32: smaller tiles
        return MixedConfig(rows_wide=32, block_n=32, block_n_narrow=32, num_warps=4)
    return MixedConfig()


def group_pad(num_q_heads: int, num_kv_heads: int) -> int:
    """Query heads per KV head, padded to a power of two: a tile's rows per token."""
    return triton.next_power_of_2(num_q_heads // num_kv_heads)


def narrow_rows(gpad: int) -> int:
    """Rows of a narrow tile: 16 (the least `tl.dot` takes) or one token's heads."""
    return max(16, gpad)


def max_work_items(
    max_tokens: int, max_requests: int, gpad: int, rows_wide: int, num_splits: int
) -> int:
    """Attention items of any step of at most `max_tokens` rows and `max_requests` requests (a
    wide request of e tokens has cdiv(e, TOK_W) <= e / TOK_W + 1 blocks and more than TOK_N
    tokens; a narrow one has `num_splits` items), plus one: the launch's grid, which always
    leaves a program idle to zero the padding rows."""
    tok_w = max(1, rows_wide // gpad)
    tok_n = narrow_rows(gpad) // gpad
    wide = max_tokens // tok_w + min(max_requests, max_tokens // (tok_n + 1))
    narrow = min(max_requests, max_tokens) * num_splits
    return wide + narrow + 1


@triton.jit
def _pick(values, offs, index):
    """values[index] of a [BLOCK_B] vector, as a scalar."""
    return tl.sum(tl.where(offs == index, values, 0), 0)


@triton.jit
def _row_layout(kv_head, t0, ext, GROUP: tl.constexpr, GPAD: tl.constexpr, ROWS: tl.constexpr):
    """(token index among the request's new ones, query head, real row) of a tile's ROWS rows
    starting at new token t0: rows are (token, head of the group) pairs, heads fastest."""
    r = tl.arange(0, ROWS)
    tok = t0 + r // GPAD
    hg = r % GPAD
    return tok, kv_head * GROUP + hg, (tok < ext) & (hg < GROUP)


@triton.jit
def _load_q(q_ptr, rows, heads, valid, stride_qt, stride_qh, HEAD_DIM: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    return tl.load(ptrs, mask=valid[:, None], other=0.0)


@triton.jit(do_not_specialize=["stride_bt", "num_requests", "num_rows", "num_splits"])
def _mixed_kernel(
    # as `_extend_kernel`'s (Tp rows, Bmax requests), without extend_lens_ptr
    q_ptr, k_ptr, v_ptr, block_table_ptr, seq_lens_ptr, cu_extend_ptr, o_ptr,
    part_o_ptr,  # [Bmax, Hkv, ROWS_N, num_splits, D] fp32 (SPLIT)
    part_lse_ptr,  # [Bmax, Hkv, ROWS_N, num_splits] fp32 (SPLIT)
    counter_ptr,  # [Bmax, Hkv] int32, zero between launches (SPLIT)
    k_scale_ptr, v_scale_ptr,  # [Hkv] fp32 (KV_FP8)
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_bt, stride_ot,
    stride_oh,
    num_requests,  # Bmax
    num_rows,  # Tp
    num_splits, scale_log2, GROUP: tl.constexpr, GPAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_B: tl.constexpr,  # next power of two >= Bmax
    ROWS_W: tl.constexpr, BLOCK_N: tl.constexpr, ROWS_N: tl.constexpr,
    BLOCK_N_NARROW: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,  # num_splits > 1
    KV_FP8: tl.constexpr, IEEE: tl.constexpr, EMULATE_BF16: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    kv_head = tl.program_id(0)
    TOK_W: tl.constexpr = ROWS_W // GPAD
    TOK_N: tl.constexpr = ROWS_N // GPAD

    # The step's work, from cu_extend alone: a few hundred integers, read from L2.
    offs_b = tl.arange(0, BLOCK_B)
    in_batch = offs_b < num_requests
    lo = tl.load(cu_extend_ptr + offs_b, mask=in_batch, other=0)
    ext = tl.load(cu_extend_ptr + offs_b + 1, mask=in_batch, other=0) - lo
    wide = tl.where(ext > TOK_N, (ext + TOK_W - 1) // TOK_W, 0)
    narrow = ((ext > 0) & (ext <= TOK_N)).to(tl.int32)
    cu_wide = tl.cumsum(wide, 0)
    cu_narrow = tl.cumsum(narrow, 0)
    num_wide = tl.sum(wide, 0)
    num_busy = num_wide + tl.sum(narrow, 0) * num_splits

    offs_d = tl.arange(0, HEAD_DIM)
    k_base = k_ptr + kv_head * stride_kh + offs_d[None, :]
    v_base = v_ptr + kv_head * stride_vh
    qk_scale = scale_log2
    if KV_FP8:  # e4m3 K/V are widened in registers; their scales act on scores and output
        qk_scale = scale_log2 * tl.load(k_scale_ptr + kv_head)

    item = tl.program_id(1)
    if item < num_wide:
        _wide_item(
            item, kv_head, offs_b, lo, ext, cu_wide, q_ptr, block_table_ptr, seq_lens_ptr, o_ptr,
            v_scale_ptr, k_base, v_base, stride_qt, stride_qh, stride_kt, stride_vt, stride_bt,
            stride_ot, stride_oh, qk_scale, GROUP, GPAD, HEAD_DIM, ROWS_W, BLOCK_N, PAGE_SIZE,
            KV_FP8, IEEE, EMULATE_BF16,
        )  # fmt: skip
    elif item < num_busy:
        _narrow_item(
            item - num_wide, kv_head, offs_b, lo, ext, cu_narrow, num_splits, q_ptr,
            block_table_ptr, seq_lens_ptr, o_ptr, part_o_ptr, part_lse_ptr, counter_ptr,
            v_scale_ptr, k_base, v_base, stride_qt, stride_qh, stride_kt, stride_vt, stride_bt,
            stride_ot, stride_oh, qk_scale, GROUP, GPAD, HEAD_DIM, ROWS_N, BLOCK_N_NARROW,
            PAGE_SIZE, SPLIT, KV_FP8, IEEE, EMULATE_BF16,
        )  # fmt: skip
    else:
        # Idle (the grid has at least one program more than the step's items): the padding
        # rows' zeros, spread over the idle programs.
        total = tl.load(cu_extend_ptr + num_requests)
        idle = item - num_busy
        num_idle = tl.num_programs(1) - num_busy
        for t0 in range(total + idle * TOK_N, num_rows, num_idle * TOK_N):
            _zero_rows(o_ptr, kv_head, t0, num_rows, stride_ot, stride_oh, GROUP, GPAD, HEAD_DIM,
                       ROWS_N)  # fmt: skip


@triton.jit
def _zero_rows(
    o_ptr, kv_head, t0, num_rows, stride_ot, stride_oh, GROUP: tl.constexpr, GPAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, ROWS_N: tl.constexpr,
):  # fmt: skip
    """Zeros in one KV head's columns of rows t0 .. t0 + ROWS_N / GPAD - 1 (< num_rows)."""
    tok, heads, valid = _row_layout(kv_head, t0, num_rows, GROUP, GPAD, ROWS_N)
    dst = o_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh
    dst = dst + tl.arange(0, HEAD_DIM)[None, :]
    tl.store(dst, tl.zeros([ROWS_N, HEAD_DIM], o_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _wide_item(
    item, kv_head, offs_b, lo, ext, cu_wide, q_ptr, block_table_ptr, seq_lens_ptr, o_ptr,
    v_scale_ptr, k_base, v_base, stride_qt, stride_qh, stride_kt, stride_vt, stride_bt,
    stride_ot, stride_oh, qk_scale, GROUP: tl.constexpr, GPAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, ROWS_W: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, KV_FP8: tl.constexpr, IEEE: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    """Wide item `item` of one KV head: a q-block of TOK_W tokens of a prefill request."""
    TOK_W: tl.constexpr = ROWS_W // GPAD
    offs_d = tl.arange(0, HEAD_DIM)
    b = tl.sum((cu_wide <= item).to(tl.int32), 0)
    t0 = (_pick(cu_wide, offs_b, b) - 1 - item) * TOK_W  # the request's last block first
    e = _pick(ext, offs_b, b)
    first_row = _pick(lo, offs_b, b).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b)
    prefix_len = seq_len - e
    tok, heads, valid = _row_layout(kv_head, t0, e, GROUP, GPAD, ROWS_W)
    q = _load_q(q_ptr, first_row + tok, heads, valid, stride_qt, stride_qh, HEAD_DIM)
    if KV_FP8:
        q = fp8_operand(q, q)
    q_pos = prefix_len + tok
    table_row = block_table_ptr + b * stride_bt
    m_i, l_i, acc = softmax_init(ROWS_W, HEAD_DIM)
    # Keys before the block's first query: visible to every row, no mask but the length.
    full_end = (prefix_len + t0) // BLOCK_N * BLOCK_N
    m_i, l_i, acc = attend_keys(
        q, q_pos, table_row, k_base, v_base, stride_kt, stride_vt, m_i, l_i, acc, 0,
        full_end, qk_scale, False, BLOCK_N, PAGE_SIZE, KV_FP8, IEEE, EMULATE_BF16, False,
    )  # fmt: skip
    causal_end = tl.minimum(seq_len, prefix_len + t0 + TOK_W)
    m_i, l_i, acc = attend_keys(
        q, q_pos, table_row, k_base, v_base, stride_kt, stride_vt, m_i, l_i, acc, full_end,
        causal_end, qk_scale, True, BLOCK_N, PAGE_SIZE, KV_FP8, IEEE, EMULATE_BF16, False,
    )  # fmt: skip
    out, _ = normalize(acc, l_i, v_scale_ptr, kv_head, KV_FP8)
    if EMULATE_BF16:
        out = round_bf16(out)
    rows = first_row + tok
    o_dst = o_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_dst, out.to(o_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _narrow_item(
    idx, kv_head, offs_b, lo, ext, cu_narrow, num_splits, q_ptr, block_table_ptr, seq_lens_ptr,
    o_ptr, part_o_ptr, part_lse_ptr, counter_ptr, v_scale_ptr, k_base, v_base, stride_qt,
    stride_qh, stride_kt, stride_vt, stride_bt, stride_ot, stride_oh, qk_scale,
    GROUP: tl.constexpr, GPAD: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS_N: tl.constexpr,
    BLOCK_N_NARROW: tl.constexpr, PAGE_SIZE: tl.constexpr, SPLIT: tl.constexpr,
    KV_FP8: tl.constexpr, IEEE: tl.constexpr, EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    """Narrow item `idx` of one KV head: one key split of a decode (or short extend) tile."""
    offs_d = tl.arange(0, HEAD_DIM)
    split = idx % num_splits
    b = tl.sum((cu_narrow <= idx // num_splits).to(tl.int32), 0)
    e = _pick(ext, offs_b, b)
    first_row = _pick(lo, offs_b, b).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b)
    tok, heads, valid = _row_layout(kv_head, 0, e, GROUP, GPAD, ROWS_N)
    q = _load_q(q_ptr, first_row + tok, heads, valid, stride_qt, stride_qh, HEAD_DIM)
    if KV_FP8:
        q = fp8_operand(q, q)
    split_len = kv_split_len(seq_len, num_splits, BLOCK_N_NARROW)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    m_i, l_i, acc = softmax_init(ROWS_N, HEAD_DIM)
    # A split may lie wholly after an earlier token's position: MAY_BE_EMPTY.
    m_i, l_i, acc = attend_keys(
        q, seq_len - e + tok, block_table_ptr + b * stride_bt, k_base, v_base, stride_kt,
        stride_vt, m_i, l_i, acc, start, end, qk_scale, True, BLOCK_N_NARROW, PAGE_SIZE,
        KV_FP8, IEEE, EMULATE_BF16, SPLIT,
    )  # fmt: skip
    out, l_safe = normalize(acc, l_i, v_scale_ptr, kv_head, KV_FP8)
    rows = first_row + tok
    o_dst = o_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    if SPLIT:
        # Partials of (request, KV head, tile row, split); split 0 of each row first.
        part = ((b * tl.num_programs(0) + kv_head) * ROWS_N + tl.arange(0, ROWS_N)) * num_splits
        mask = valid & (tok * 0 + start < end)  # a vector: the interpreter wants one
        tl.store(
            part_o_ptr + (part + split)[:, None] * HEAD_DIM + offs_d[None, :], out,
            mask=mask[:, None],
        )  # fmt: skip
        tl.store(part_lse_ptr + part + split, m_i + tl.log2(l_safe), mask=mask)
        # As in decode.py: the last split of this (request, KV head) to finish combines.
        tl.debug_barrier()
        counter = counter_ptr + b * tl.num_programs(0) + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
            tl.store(counter, 0)  # zero again for the next launch (or graph replay)
            num_valid = tl.cdiv(seq_len, split_len)
            combine_splits(
                part_o_ptr, part_lse_ptr, o_dst, part, num_valid, valid, HEAD_DIM, ROWS_N,
                EMULATE_BF16,
            )  # fmt: skip
    else:
        if EMULATE_BF16:
            out = round_bf16(out)
        tl.store(o_dst, out.to(o_ptr.dtype.element_ty), mask=valid[:, None])


def mixed_attention(
    q: torch.Tensor,  # [Tp, Hq, D]: rows past cu_extend[Bmax] are padding
    k_cache: torch.Tensor,  # [num_slots, Hkv, D], already holding the new tokens' K
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    block_table: torch.Tensor,  # [Bmax, P] int32 page ids
    seq_lens: torch.Tensor,  # [Bmax] int32, context length after this step (any past the step)
    cu_extend: torch.Tensor,  # [Bmax+1] int32, request b's rows; constant past the step
    page_size: int,
    sm_scale: float,
    *,
    num_splits: int = 1,  # narrow items' key splits: fixed per capture, any value is correct
    config: MixedConfig | None = None,
    out: torch.Tensor | None = None,  # [Tp, Hq, D], written in place if given
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # FP8 cache: [Hkv] fp32 each
) -> torch.Tensor:  # [Tp, Hq, D], dtype of q; padding rows are zeros
    """Attention of every row of a mixed step (the module docstring), one launch whose grid and
    buffers depend only on the shapes (Tp, Bmax, P) and `num_splits`: no host sync, no
    allocation that depends on the step, so a CUDA graph captured with these buffers replays it
    for any composition. Run it once outside a capture first (its split counters)."""
    num_rows, num_q_heads, head_dim = q.shape
    num_requests = seq_lens.shape[0]
    num_kv_heads = k_cache.shape[1]
    out, (k_scale, v_scale), strides, flags = paged_launch(
        _mixed_kernel, q, k_cache, v_cache, block_table, seq_lens, kv_scales, out, cu_extend
    )
    cfg = config or default_mixed_config(head_dim, q.element_size())
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if num_rows == 0 or num_requests == 0:
        return out
    gpad = group_pad(num_q_heads, num_kv_heads)
    rows_n = narrow_rows(gpad)
    rows_w = max(cfg.rows_wide, gpad)  # at least one token per wide block
    items = max_work_items(num_rows, num_requests, gpad, rows_w, num_splits)
    if num_splits > 1:
        parts = num_requests * num_kv_heads * rows_n * num_splits
        part_o = q.new_empty(parts * head_dim, dtype=torch.float32)
        part_lse = q.new_empty(parts, dtype=torch.float32)
        counters = split_counters(q.device, num_requests * num_kv_heads)
    else:
        part_o = part_lse = out  # unread
        counters = seq_lens
    _mixed_kernel[(num_kv_heads, items)](
        q, k_cache, v_cache, block_table, seq_lens, cu_extend, out, part_o, part_lse, counters,
        k_scale, v_scale, *strides, num_requests, num_rows, num_splits,
        sm_scale * math.log2(math.e), GROUP=num_q_heads // num_kv_heads, GPAD=gpad,
        HEAD_DIM=head_dim, BLOCK_B=max(16, triton.next_power_of_2(num_requests)), ROWS_W=rows_w,
        BLOCK_N=cfg.block_n, ROWS_N=rows_n, BLOCK_N_NARROW=cfg.block_n_narrow,
        PAGE_SIZE=page_size, SPLIT=num_splits > 1, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **flags,
    )  # fmt: skip
    return out
