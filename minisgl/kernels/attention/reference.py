"""Pure-torch references for the attention kernels (any device, fp32 math, no Triton).

They gather each request's context from the paged pool and attend with an explicit softmax;
slow and memory-hungry by design, for tests and benchmark error checks. An FP8 pool comes with
its per-KV-head scales (`kv_scales`): stored values are divided by them, read ones multiplied.
"""

from __future__ import annotations

import torch

from minisgl.kernels.fp8 import quantize_kv, store_v_rows, v_rows

KVScales = tuple[torch.Tensor, torch.Tensor]  # (k_scale, v_scale), [Hkv] fp32 each

# Query rows attended at once, bounding the [heads, rows, context] score tensor.
_QUERY_CHUNK = 1024


def store_kv_ref(
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]; FP8: [pages, Hkv, D, page_size] (`kernels.fp8`)
    loc: torch.Tensor,  # [T] int64
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_scales: KVScales | None = None,
    k_shift: torch.Tensor | None = None,  # [Hkv, D] fp32 with kv_scales
) -> None:
    if kv_scales is not None:
        k_cache[loc] = quantize_kv(k, kv_scales[0], k_shift)
        store_v_rows(v_cache, loc, quantize_kv(v, kv_scales[1]))
        return
    k_cache[loc] = k.to(k_cache.dtype)
    v_cache[loc] = v.to(v_cache.dtype)


def gather_kv(
    cache: torch.Tensor,  # [num_slots, Hkv, D], or an FP8 pool's V [pages, Hkv, D, page_size]
    slots: torch.Tensor,  # [L] int64
    scale: torch.Tensor | None,  # [Hkv] fp32 of an FP8 cache
) -> torch.Tensor:  # [L, Hkv, D], fp32 when scaled
    rows = v_rows(cache, slots)
    return rows if scale is None else rows.float() * scale[:, None]


def context_slots(
    block_row: torch.Tensor,  # [P] int32 page ids of one request
    seq_len: int,
    page_size: int,
) -> torch.Tensor:  # [seq_len] int64
    pos = torch.arange(seq_len, device=block_row.device)
    return block_row.long()[pos // page_size] * page_size + pos % page_size


def attend_ref(
    q: torch.Tensor,  # [n, Hq, D]
    k: torch.Tensor,  # [L, Hkv, D]
    v: torch.Tensor,  # [L, Hkv, D]
    q_pos: torch.Tensor,  # [n] int64, position of each query; key j is visible iff j <= q_pos
    sm_scale: float,
) -> torch.Tensor:  # [n, Hq, D] fp32
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    k_pos = torch.arange(k.shape[0], device=k.device)
    out = []
    for lo in range(0, q.shape[0], _QUERY_CHUNK):
        qc, pc = q[lo : lo + _QUERY_CHUNK].float(), q_pos[lo : lo + _QUERY_CHUNK]
        scores = torch.einsum("nhd,lhd->hnl", qc, k) * sm_scale
        scores.masked_fill_(k_pos[None, None, :] > pc[None, :, None], float("-inf"))
        out.append(torch.einsum("hnl,lhd->nhd", scores.softmax(dim=-1), v))
    return torch.cat(out) if out else q.new_zeros(q.shape, dtype=torch.float32)


def extend_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D], already holding the new tokens
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]; FP8: [pages, Hkv, D, page_size]
    block_table: torch.Tensor,  # [B, P] int32
    seq_lens: torch.Tensor,  # [B] int32
    extend_lens: torch.Tensor,  # [B] int32
    cu_extend: torch.Tensor,  # [B+1] int32
    page_size: int,
    sm_scale: float,
    kv_scales: KVScales | None = None,
) -> torch.Tensor:  # [T, Hq, D] fp32
    ks, vs = kv_scales if kv_scales is not None else (None, None)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    rows = zip(seq_lens.tolist(), extend_lens.tolist(), cu_extend.tolist(), strict=False)
    for i, (seq_len, ext_len, first) in enumerate(rows):
        if ext_len == 0:
            continue
        slots = context_slots(block_table[i], seq_len, page_size)
        q_pos = torch.arange(seq_len - ext_len, seq_len, device=q.device)
        q_i = q[first : first + ext_len]
        k, v = gather_kv(k_cache, slots, ks), gather_kv(v_cache, slots, vs)
        out[first : first + ext_len] = attend_ref(q_i, k, v, q_pos, sm_scale)
    return out


def decode_attention_ref(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]; FP8: [pages, Hkv, D, page_size]
    block_table: torch.Tensor,  # [B, P] int32
    seq_lens: torch.Tensor,  # [B] int32
    page_size: int,
    sm_scale: float,
    kv_scales: KVScales | None = None,
) -> torch.Tensor:  # [B, Hq, D] fp32; a request with no context gets zeros
    """One query a request, the last of its context: an extend of one token (none when empty)."""
    ext = (seq_lens > 0).int()
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return extend_attention_ref(
        q, k_cache, v_cache, block_table, seq_lens, ext, cu, page_size, sm_scale, kv_scales
    )
