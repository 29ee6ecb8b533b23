"""Paged decode attention, flash-decoding style: one query token per request.

Each program owns one (request, KV head, split): it reads that split's K/V once for every query
head of the GQA group (the group is padded to BLOCK_H rows so the scores are one `tl.dot`),
keeps an online softmax, and writes a normalised partial output plus its base-2 log-sum-exp;
the last split of a (request, KV head) to finish combines them (counted with an atomic), so a
decode is one kernel. A split is a fraction of *its own request's* length, so any
`num_splits` is correct for any `seq_lens`: the caller picks it from host-side numbers and the
launch needs no host sync (CUDA-graph safe).
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
    kv_split_len,
    load_q,
    normalize,
    paged_launch,
    softmax_init,
)
from minisgl.kernels.common import num_sms, pdl_prologue, round_bf16, split_counters


@dataclass(frozen=True)
class DecodeConfig:
    """Tuning knobs of `decode_attention` (sweep them on the target GPU)."""

    block_n: int = 64  # key tokens per loop step
    # ... when a request is one program (no splits: large batches)
    block_n_unsplit: int = 128
    num_warps: int = 4
    num_stages: int = 3  # H200 sweep: 4.46 TB/s at 256 x 4096 (2 stages: 4.23)
    # Split heuristic: aim for this many programs per SM, never splits shorter than this.
    programs_per_sm: int = 4
    min_split_tokens: int = 64  # 256 left batch-1 W2 steps with 2 splits of a 300-token context
    max_splits: int = 64

    def __post_init__(self) -> None:
        check_tile_sizes(self, "block_n", "block_n_unsplit")


def default_decode_config(head_dim: int, kv_fp8: bool = False) -> DecodeConfig:
    if kv_fp8:
        # The best of `python -m minisgl.benchmark.tune decode --kv-cache-dtype fp8_e4m3` on an
        # H200 (head_dim 128): 0.933 of the copy bandwidth at batch 256 x 4096 tokens.
        block = max(16, min(256, 16384 // head_dim))
        return DecodeConfig(block_n=block, block_n_unsplit=block, num_warps=4, num_stages=3)
    # ~16 KiB per K (or V) tile in bf16: Triton keeps one K and one V tile in flight per program
    # (sm_90 build: 80 registers, 38 KiB shared, so ~5 programs per SM).
    return DecodeConfig(
        block_n=max(16, min(128, 8192 // head_dim)),
        block_n_unsplit=max(16, min(128, 16384 // head_dim)),
    )


def choose_num_splits(
    batch_size: int, num_kv_heads: int, max_seq_len: int, sms: int, config: DecodeConfig
) -> int:
    """Splits per request: about `programs_per_sm` programs per SM (one wave, if that many fit
    on an SM at once), each split at least `min_split_tokens` long."""
    want = config.programs_per_sm * sms // max(1, batch_size * num_kv_heads)
    by_len = -(-max_seq_len // config.min_split_tokens)
    return max(1, min(want, by_len, config.max_splits))


# Per-step integers are not specialised on (== 1, % 16): a variant each would be a JIT compile
# in the middle of serving.
@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _decode_split_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [slots, Hkv, D]
    v_ptr,  # [slots, Hkv, D]
    block_table_ptr,  # [B, P] int32
    seq_lens_ptr,  # [B] int32
    o_ptr,  # [B, Hq, D], written when SINGLE_SPLIT
    part_o_ptr,  # [B, Hq, num_splits, D] fp32, written otherwise
    part_lse_ptr,  # [B, Hq, num_splits] fp32
    counter_ptr,  # [B, Hkv] int32, zero between launches: splits of a (request, KV head) done
    k_scale_ptr,  # [Hkv] fp32 (KV_FP8)
    v_scale_ptr,  # [Hkv] fp32 (KV_FP8)
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_bt, stride_ob,
    stride_oh, num_q_heads, num_splits, scale_log2, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, KV_FP8: tl.constexpr, IEEE: tl.constexpr,
    EMULATE_BF16: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    # KV heads vary fastest: CTAs launched together read neighbouring 256-byte head slices of
    # the same tokens, so DRAM sees whole token rows (and whole pages) rather than scattered bits.
    kv_head = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b)
    split_len = kv_split_len(seq_len, num_splits, BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_h
    mask_h = offs_h < GROUP
    q_ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q, qk_scale = load_q(q_ptrs, mask_h, scale_log2, k_scale_ptr, kv_head, KV_FP8)  # [BLOCK_H, D]

    table_row = block_table_ptr + b * stride_bt
    k_base = k_ptr + kv_head * stride_kh + offs_d[None, :]
    v_base = v_ptr + kv_head * stride_vh
    m_i, l_i, acc = softmax_init(BLOCK_H, HEAD_DIM)
    m_i, l_i, acc = attend_keys(
        q, None, table_row, k_base, v_base, stride_kt, stride_vt, m_i, l_i, acc, start, end,
        qk_scale, False, BLOCK_N, PAGE_SIZE, KV_FP8, IEEE, EMULATE_BF16,
    )  # fmt: skip

    # An empty request (seq_len 0, e.g. CUDA-graph padding) yields zeros, not NaN.
    out, l_safe = normalize(acc, l_i, v_scale_ptr, kv_head, KV_FP8)
    if SINGLE_SPLIT:
        if EMULATE_BF16:
            out = round_bf16(out)
        o_dst = o_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_dst, out.to(o_ptr.dtype.element_ty), mask=mask_h[:, None])
    else:
        # Splits past the end of a short request write nothing; the combine skips them.
        rows = (b * num_q_heads + heads) * num_splits  # [BLOCK_H], split 0 of each head
        mask = offs_h < tl.where(start < end, GROUP, 0)
        part_o = part_o_ptr + (rows + split)[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(part_o, out, mask=mask[:, None])
        tl.store(part_lse_ptr + rows + split, m_i + tl.log2(l_safe), mask=mask)
        # The last split of this (request, KV head) to finish combines them all: no second
        # kernel. The barrier and the counter's release/acquire order every split's stores
        # before the last one's loads (which bypass L1).
        tl.debug_barrier()
        counter = counter_ptr + b * tl.num_programs(0) + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
            tl.store(counter, 0)  # zero again for the next launch (or CUDA-graph replay)
            o_dst = o_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
            num_valid = tl.cdiv(seq_len, split_len)
            combine_splits(
                part_o_ptr, part_lse_ptr, o_dst, rows, num_valid, mask_h, HEAD_DIM, BLOCK_H,
                EMULATE_BF16,
            )  # fmt: skip


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]; FP8: [pages, Hkv, D, page_size] (`KVPool`)
    block_table: torch.Tensor,  # [B, P] int32 page ids, row i = pages of request i
    seq_lens: torch.Tensor,  # [B] int32, context length of each request (incl. the new token)
    page_size: int,
    sm_scale: float,
    *,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    config: DecodeConfig | None = None,
    out: torch.Tensor | None = None,  # [B, Hq, D], written in place if given
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # FP8 cache: [Hkv] fp32 each
) -> torch.Tensor:  # [B, Hq, D], dtype of q
    """Attention of each request's single query over its whole paged context. An FP8 (e4m3)
    cache comes with its per-KV-head scales; its tiles are widened in registers.

    Never syncs with the host. `num_splits` (or, when it is None, the heuristic fed with the
    host-side `max_seq_len`, default `P * page_size`) only affects speed; a CUDA graph captures
    one value and stays correct for every `seq_lens` it replays with.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    assert seq_lens.shape == (batch,)
    out, (k_scale, v_scale), strides, flags = paged_launch(
        _decode_split_kernel, q, k_cache, v_cache, block_table, seq_lens, kv_scales, out
    )
    cfg = config or default_decode_config(head_dim, flags["KV_FP8"])
    if num_splits is None:
        max_len = max_seq_len if max_seq_len is not None else block_table.shape[1] * page_size
        num_splits = choose_num_splits(batch, num_kv_heads, max_len, num_sms(q.device), cfg)
    if batch == 0:
        return out
    group = num_q_heads // num_kv_heads
    if num_splits > 1:
        part_o = q.new_empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32)
        part_lse = q.new_empty(batch, num_q_heads, num_splits, dtype=torch.float32)
        counters = split_counters(q.device, batch * num_kv_heads)
    else:
        part_o = part_lse = out  # unused by the kernel
        counters = seq_lens
    _decode_split_kernel[(num_kv_heads, batch, num_splits)](
        q, k_cache, v_cache, block_table, seq_lens, out, part_o, part_lse, counters, k_scale,
        v_scale, *strides, num_q_heads, num_splits, sm_scale * math.log2(math.e),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_N=cfg.block_n if num_splits > 1 else cfg.block_n_unsplit, PAGE_SIZE=page_size,
        SINGLE_SPLIT=num_splits == 1, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **flags,
    )  # fmt: skip
    return out
