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

from minisgl.kernels.common import (
    check_kv_scales,
    check_paged_args,
    combine_splits,
    dot,
    dot_flags,
    fp8_operand,
    is_interpreted,
    kv_split_len,
    num_sms,
    online_softmax_step,
    pdl_args,
    pdl_prologue,
    round_bf16,
    split_counters,
    token_slots,
)


@dataclass(frozen=True)
class DecodeConfig:
    """Tuning knobs of `decode_attention` (sweep them on the target GPU)."""

    block_n: int = 64  # key tokens per loop step
    # ... when a request is one program (no splits: large batches): W1-like ragged batch of 200
    # at contexts 560-1080 on the H200, 128: 156 us (1.01 of the copy bandwidth), 64: 161 us.
    block_n_unsplit: int = 128
    num_warps: int = 4
    num_stages: int = 3  # H200 sweep: 4.46 TB/s at 256 x 4096 (2 stages: 4.23)
    # Split heuristic: aim for this many programs per SM, never splits shorter than this.
    programs_per_sm: int = 4
    min_split_tokens: int = 64  # 256 left batch-1 W2 steps with 2 splits of a 300-token context
    max_splits: int = 64
    # FP8 (e4m3) cache with a 16-bit q: how the tiles are widened to fp16 (`FP8_WIDEN`). "cast"
    # lets Triton read the bytes straight into the MMA operand layouts (byte loads from shared
    # memory, ~200 registers); the others widen through inline PTX that Triton's layout
    # propagation cannot see through, so the tiles are read with 16-byte loads, widened, and
    # staged as fp16 in shared memory for ldmatrix (sm_90: ~45% fewer instructions per key).
    fp8_widen: str = "cast"
    # Scores as K q^T and the output as V^T P^T: keys and head_dim on the MMAs' M side (wgmma
    # on sm_90 without padding the query group to 64 rows).
    transposed: bool = False
    block_h: int = 16  # query rows per program at least (the GQA group is padded to this)
    # Registers per thread at most (ptxas `.maxnreg`), for more programs per SM: 128 at 4 warps
    # fits four, 80 at 8 warps three. None: the compiler's choice.
    max_registers: int | None = None
    # Full key blocks without masks, a request's (or split's) last partial block on its own:
    # fewer instructions per key (sm_90: -17% at 128 keys), one unpipelined block per program.
    # Row layout only (not with `transposed`).
    peel: bool = False

    def __post_init__(self) -> None:
        for size in (self.block_n, self.block_n_unsplit):
            if size < 16 or size & (size - 1):
                raise ValueError(f"block_n must be a power of two >= 16 (tl.dot), got {size}")
        if self.fp8_widen not in FP8_WIDEN:
            raise ValueError(
                f"fp8_widen must be one of {sorted(FP8_WIDEN)}, got {self.fp8_widen!r}"
            )
        if self.peel and self.transposed:
            raise ValueError("peel applies to the row layout only: not with transposed")
        if self.block_h < 16 or self.block_h & (self.block_h - 1):
            raise ValueError(f"block_h must be a power of two >= 16 (tl.dot), got {self.block_h}")


# fp8_widen -> (K, V) widening modes of the kernel: 0 a Triton cast; 1 `cvt.rn.f16x2.e4m3x2`
# (the conversion pipe); 2 a PRMT/SHF/LOP3 bit trick on the integer pipe (exact: it yields
# 2^-8 times the value, folded into the scales); "mixed" splits the work between the two pipes.
FP8_WIDEN = {"cast": (0, 0), "cvt": (1, 1), "bits": (2, 2), "mixed": (1, 2)}


def default_decode_config(head_dim: int, kv_fp8: bool = False) -> DecodeConfig:
    if kv_fp8:
        # The best of `benchmark.kernels --kv-cache-dtype fp8_e4m3 --decode-only --tune` on an
        # NVIDIA H200 (torch 2.11, triton 3.6, session 13), head_dim 128: 128 keys, 4 warps,
        # 5 stages reach 0.706 of the copy bandwidth at batch 256 x 4096 tokens, 0.640 at
        # 256 x 1024 and 0.636 at 32 x 4096 (8 warps, 2 stages: 0.586, 0.556, 0.53). What
        # still limits it: the e4m3 tiles widened to fp16 live whole in registers (200 per
        # thread on sm_90, 73 KiB shared), so only two programs fit on an SM; W3's target
        # is 0.85.
        block = max(16, min(256, 16384 // head_dim))
        return DecodeConfig(block_n=block, block_n_unsplit=block, num_warps=4, num_stages=5)
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
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ob,
    stride_oh,
    num_q_heads,
    num_splits,
    scale_log2,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    KV_FP8: tl.constexpr,
    IEEE: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    PDL: tl.constexpr,
    WIDEN_K: tl.constexpr,  # FP8_WIDEN's modes (0 with a 16-bit cache or an fp32 q)
    WIDEN_V: tl.constexpr,
    WIDEN_ASM: tl.constexpr,  # False under the CPU interpreter: the modes' values emulated
    TRANSPOSED: tl.constexpr,
    PEEL: tl.constexpr,  # `DecodeConfig.peel`
):
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
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None],
        other=0.0,
    )  # [BLOCK_H, D]
    qk_scale = scale_log2
    if KV_FP8:  # e4m3 K/V are widened in registers; their scales act on scores and output
        q = fp8_operand(q, q)
        qk_scale = scale_log2 * tl.load(k_scale_ptr + kv_head)
        if WIDEN_K == 2:
            qk_scale = qk_scale * 256.0

    table_row = block_table_ptr + b * stride_bt
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    if TRANSPOSED:
        m_i, l_i, acc = _attend_transposed(
            q, qk_scale, table_row, k_base, v_base, stride_kt, stride_vt, start, end, BLOCK_H,
            HEAD_DIM, BLOCK_N, PAGE_SIZE, KV_FP8, WIDEN_K, WIDEN_V, WIDEN_ASM, IEEE,
            EMULATE_BF16,
        )  # fmt: skip
    else:
        m_i, l_i, acc = _attend(
            q, qk_scale, table_row, k_base, v_base, stride_kt, stride_vt, start, end, BLOCK_H,
            HEAD_DIM, BLOCK_N, PAGE_SIZE, KV_FP8, WIDEN_K, WIDEN_V, WIDEN_ASM, IEEE,
            EMULATE_BF16, PEEL,
        )  # fmt: skip

    # An empty request (seq_len 0, e.g. CUDA-graph padding) yields zeros, not NaN.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if KV_FP8:
        out = out * tl.load(v_scale_ptr + kv_head)
        if WIDEN_V == 2:
            out = out * 256.0
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


@triton.jit
def _attend(
    q, qk_scale, table_row, k_base, v_base, stride_kt, stride_vt, start, end,
    BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, KV_FP8: tl.constexpr, WIDEN_K: tl.constexpr,
    WIDEN_V: tl.constexpr, WIDEN_ASM: tl.constexpr, IEEE: tl.constexpr,
    EMULATE_BF16: tl.constexpr, PEEL: tl.constexpr,
):  # fmt: skip
    """Keys [start, end) of one request and KV head against q [BLOCK_H, D]: the running max,
    sum and unnormalised output [BLOCK_H, D] of the online softmax (base 2)."""
    offs_d = tl.arange(0, HEAD_DIM)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    k_base = k_base + offs_d[None, :]
    v_base = v_base + offs_d[None, :]
    if PEEL:
        # A split past the end of a short request has end < start.
        full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
        for n in range(start, full_end, BLOCK_N):
            m_i, l_i, acc = _attend_block(
                q, qk_scale, table_row, k_base, v_base, stride_kt, stride_vt, n, end, m_i, l_i,
                acc, BLOCK_N, PAGE_SIZE, KV_FP8, WIDEN_K, WIDEN_V, WIDEN_ASM, IEEE,
                EMULATE_BF16, False,
            )  # fmt: skip
        if full_end < end:
            m_i, l_i, acc = _attend_block(
                q, qk_scale, table_row, k_base, v_base, stride_kt, stride_vt, full_end, end, m_i,
                l_i, acc, BLOCK_N, PAGE_SIZE, KV_FP8, WIDEN_K, WIDEN_V, WIDEN_ASM, IEEE,
                EMULATE_BF16, True,
            )  # fmt: skip
    else:
        for n in range(start, end, BLOCK_N):
            m_i, l_i, acc = _attend_block(
                q, qk_scale, table_row, k_base, v_base, stride_kt, stride_vt, n, end, m_i, l_i,
                acc, BLOCK_N, PAGE_SIZE, KV_FP8, WIDEN_K, WIDEN_V, WIDEN_ASM, IEEE,
                EMULATE_BF16, True,
            )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _attend_block(
    q, qk_scale, table_row, k_base, v_base, stride_kt, stride_vt, n, end, m_i, l_i, acc,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, KV_FP8: tl.constexpr,
    WIDEN_K: tl.constexpr, WIDEN_V: tl.constexpr, WIDEN_ASM: tl.constexpr, IEEE: tl.constexpr,
    EMULATE_BF16: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """One key block [n, n + BLOCK_N) folded into the online softmax; MASKED when it may reach
    past `end`."""
    pos = n + tl.arange(0, BLOCK_N)
    if MASKED:
        mask_n = pos < end
        slots = token_slots(table_row, tl.minimum(pos, end - 1), PAGE_SIZE)
        k = tl.load(k_base + slots[:, None] * stride_kt, mask=mask_n[:, None], other=0.0)
    else:
        slots = token_slots(table_row, pos, PAGE_SIZE)
        k = tl.load(k_base + slots[:, None] * stride_kt)
    if KV_FP8:
        k = _widen_e4m3(k, q, WIDEN_K, WIDEN_ASM)
    qk = dot(q, tl.trans(k), IEEE, EMULATE_BF16) * qk_scale  # [BLOCK_H, BLOCK_N]
    if MASKED:
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        v = tl.load(v_base + slots[:, None] * stride_vt, mask=mask_n[:, None], other=0.0)
    else:
        v = tl.load(v_base + slots[:, None] * stride_vt)
    if KV_FP8:
        v = _widen_e4m3(v, q, WIDEN_V, WIDEN_ASM)
    return online_softmax_step(qk, v, m_i, l_i, acc, IEEE, EMULATE_BF16)


@triton.jit
def _attend_transposed(
    q, qk_scale, table_row, k_base, v_base, stride_kt, stride_vt, start, end,
    BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, KV_FP8: tl.constexpr, WIDEN_K: tl.constexpr,
    WIDEN_V: tl.constexpr, WIDEN_ASM: tl.constexpr, IEEE: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    """`_attend` with scores S^T = K q^T [BLOCK_N, BLOCK_H] (softmax along axis 0) and the
    output O^T += V^T P^T [D, BLOCK_H]: keys and head_dim are the MMAs' M side."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    q_t = tl.trans(q)  # [D, BLOCK_H]
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_t = tl.zeros([HEAD_DIM, BLOCK_H], tl.float32)
    k_base = k_base + offs_d[None, :]
    v_base = v_base + offs_d[:, None]
    for n in range(start, end, BLOCK_N):
        pos = n + offs_n
        mask_n = pos < end
        slots = token_slots(table_row, tl.minimum(pos, end - 1), PAGE_SIZE)
        k = tl.load(k_base + slots[:, None] * stride_kt, mask=mask_n[:, None], other=0.0)
        if KV_FP8:
            k = _widen_e4m3(k, q, WIDEN_K, WIDEN_ASM)
        s_t = dot(k, q_t, IEEE, EMULATE_BF16) * qk_scale  # [BLOCK_N, BLOCK_H]
        s_t = tl.where(mask_n[:, None], s_t, float("-inf"))
        v_t = tl.load(v_base + slots[None, :] * stride_vt, mask=mask_n[None, :], other=0.0)
        if KV_FP8:
            v_t = _widen_e4m3(v_t, q, WIDEN_V, WIDEN_ASM)
        m_new = tl.maximum(m_i, tl.max(s_t, 0))
        alpha = tl.exp2(m_i - m_new)
        p_t = tl.exp2(s_t - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p_t, 0)
        if EMULATE_BF16:
            pv_t = dot(v_t, round_bf16(p_t), IEEE, EMULATE_BF16)
        else:
            pv_t = dot(v_t, p_t.to(v_t.dtype), IEEE, EMULATE_BF16)
        acc_t = acc_t * alpha[None, :] + pv_t
        m_i = m_new
    return m_i, l_i, tl.trans(acc_t)


# e4m3 -> fp16, four bytes of a 32-bit word into two f16x2 words (byte i is element i).
_CVT_E4M3 = tl.constexpr(
    "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
    "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }"
)
# The same values times 2^-8 without the conversion pipe: PRMT places byte b in the high byte
# of a 16-bit lane and b's sign (replicated) in the byte above it; an arithmetic shift by one
# then puts the sign at bit 15 and b's exponent and mantissa at bits 13..7, where fp16 keeps
# them (its exponent bias is 8 above e4m3's, subnormals included); the AND clears the sign's
# copy at bit 14 and the bits shifted in from the byte above. e4m3's NaN (never stored) would
# read as 480.
_BITS_E4M3 = tl.constexpr(
    "{ .reg .b32 a0, a1; prmt.b32 a0, $2, 0, 0x1804; prmt.b32 a1, $2, 0, 0x3A24; "
    "shr.s32 a0, a0, 1; shr.s32 a1, a1, 1; "
    "and.b32 $0, a0, 0xBF80BF80; and.b32 $1, a1, 0xBF80BF80; }"
)


@triton.jit
def _widen_e4m3(x, q, MODE: tl.constexpr, ASM: tl.constexpr):
    """An e4m3 tile widened for the dots with q (modes: `FP8_WIDEN`; 1 and 2 need a 16-bit q,
    and mode 2 yields 2^-8 times the value). The inline PTX is declared impure so Triton keeps
    the widening where it is written: otherwise it moves the layout conversion onto the e4m3
    bytes, which then reach the MMA operand layouts one byte per load."""
    if MODE == 0:
        out = fp8_operand(x, q)
    elif not ASM:  # the CPU interpreter runs no PTX: the same values
        out = x.to(tl.float16)
        if MODE == 2:
            out = out * 0.00390625
    elif MODE == 1:
        out = tl.inline_asm_elementwise(
            _CVT_E4M3, "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False,
            pack=4,
        )  # fmt: skip
    else:
        out = tl.inline_asm_elementwise(
            _BITS_E4M3, "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False,
            pack=4,
        )  # fmt: skip
    return out


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
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
    _check_decode_args(q, k_cache, v_cache, block_table, seq_lens)
    fp8 = check_kv_scales(k_cache, kv_scales, num_kv_heads)
    cfg = config or default_decode_config(head_dim, fp8)
    if num_splits is None:
        max_len = max_seq_len if max_seq_len is not None else block_table.shape[1] * page_size
        num_splits = choose_num_splits(batch, num_kv_heads, max_len, num_sms(q.device), cfg)
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
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
    ieee, emulate_bf16 = dot_flags(q.dtype, _decode_split_kernel, fp8)
    # The staged widenings feed fp16 dots: an fp32 q keeps the fp32 cast.
    widen_k, widen_v = FP8_WIDEN[cfg.fp8_widen] if fp8 and not ieee else (0, 0)
    k_scale, v_scale = kv_scales if kv_scales is not None else (seq_lens, seq_lens)  # unread
    pdl = pdl_args(q.device)
    _decode_split_kernel[(num_kv_heads, batch, num_splits)](
        q, k_cache, v_cache, block_table, seq_lens, out, part_o, part_lse, counters, k_scale,
        v_scale, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), block_table.stride(0),
        out.stride(0), out.stride(1), num_q_heads, num_splits, sm_scale * math.log2(math.e),
        GROUP=group, BLOCK_H=max(cfg.block_h, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_N=cfg.block_n if num_splits > 1 else cfg.block_n_unsplit, PAGE_SIZE=page_size, SINGLE_SPLIT=num_splits == 1, KV_FP8=fp8, IEEE=ieee,
        EMULATE_BF16=emulate_bf16, WIDEN_K=widen_k, WIDEN_V=widen_v,
        WIDEN_ASM=not is_interpreted(_decode_split_kernel), TRANSPOSED=cfg.transposed,
        PEEL=cfg.peel,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl, **_register_cap(cfg),
    )  # fmt: skip
    return out


def _register_cap(cfg: DecodeConfig) -> dict[str, int]:
    return {} if cfg.max_registers is None else {"maxnreg": cfg.max_registers}


def _check_decode_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    batch = q.shape[0]
    check_paged_args(q, k_cache, v_cache, block_table, batch)
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (batch,)
    assert seq_lens.is_contiguous()
