"""Random paged KV batches for kernel tests and benchmarks (pure torch, no Triton)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.kernels.fp8 import is_fp8, quantize_kv
from minisgl.kernels.reference import context_slots


@dataclass
class PagedKV:
    """One layer's KV pool holding a batch of requests on randomly scattered pages."""

    k_cache: torch.Tensor  # [num_pages * page_size, Hkv, D]
    v_cache: torch.Tensor  # [num_pages * page_size, Hkv, D]
    block_table: torch.Tensor  # [B, P] int32 page ids
    seq_lens: torch.Tensor  # [B] int32
    seq_lens_host: list[int]
    page_size: int
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None  # FP8 pools: [Hkv] fp32 each

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host, default=0)


def random_paged_kv(
    seq_lens: list[int],
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    spare_pages: int = 2,
    poison: bool = True,
) -> PagedKV:
    """Requests get disjoint pages in random order (not contiguous).

    With `poison`, every slot that is not part of some request's context (spare pages, the tail
    of a last page, table entries past a request's pages) holds NaN, so a kernel that reads
    outside a context produces NaN. Without it the whole pool is random (cheap for huge pools).
    An e4m3 pool (`torch.float8_e4m3fn`) comes with per-KV-head scales (`PagedKV.kv_scales`).
    """
    pages_per_req = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_req) + spare_pages
    perm = torch.randperm(num_pages, device=device).to(torch.int32)
    poison_page = perm[-1]  # a spare page: never part of a context
    width = max(max(pages_per_req, default=0), 1)
    table = poison_page.repeat(len(seq_lens), width)
    start = 0
    for i, n in enumerate(pages_per_req):
        table[i, :n] = perm[start : start + n]
        start += n

    shape = (num_pages * page_size, num_kv_heads, head_dim)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    if is_fp8(dtype):
        return _fp8_paged_kv(shape, table, lens, list(seq_lens), page_size, poison)
    k_cache = torch.empty(shape, dtype=dtype, device=device)
    v_cache = torch.empty(shape, dtype=dtype, device=device)
    if poison:
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
        slots = context_slots_of(table, seq_lens, page_size)
        k_cache[slots] = torch.randn((slots.numel(), *shape[1:]), dtype=dtype, device=device)
        v_cache[slots] = torch.randn((slots.numel(), *shape[1:]), dtype=dtype, device=device)
    else:
        k_cache.normal_()
        v_cache.normal_()
    return PagedKV(k_cache, v_cache, table, lens, list(seq_lens), page_size)


def _fp8_paged_kv(
    shape: tuple[int, int, int],
    table: torch.Tensor,
    lens: torch.Tensor,
    seq_lens: list[int],
    page_size: int,
    poison: bool,
) -> PagedKV:
    """e4m3 pools of normal values with a magnitude per KV head, quantized with 8 sigma of
    headroom, filled a chunk of slots at a time (a benchmark's pool has billions of values)."""
    device = table.device
    caches, scales = [], []
    for _ in range(2):  # K, then V
        magnitude = 2.0 ** torch.randint(-3, 4, (shape[1],), device=device).float()  # [Hkv]
        scale = magnitude * 8 / 448
        cache = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
        step = max(1, (1 << 24) // (shape[1] * shape[2]))
        for start in range(0, shape[0], step):
            rows = min(step, shape[0] - start)
            values = torch.randn((rows, *shape[1:]), device=device) * magnitude[:, None]
            cache[start : start + rows] = quantize_kv(values, scale)
        if poison:
            keep = torch.zeros(shape[0], dtype=torch.bool, device=device)
            keep[context_slots_of(table, seq_lens, page_size)] = True
            cache.view(torch.uint8)[~keep] = 0x7F  # e4m3 NaN (no masked_fill for e4m3)
        caches.append(cache)
        scales.append(scale)
    return PagedKV(caches[0], caches[1], table, lens, seq_lens, page_size, (scales[0], scales[1]))


def context_slots_of(
    block_table: torch.Tensor,  # [B, P] int32
    seq_lens: list[int],
    page_size: int,
) -> torch.Tensor:  # [sum(seq_lens)] int64, every context slot, request by request
    rows = [context_slots(block_table[i], n, page_size) for i, n in enumerate(seq_lens)]
    return torch.cat(rows) if rows else block_table.new_zeros(0, dtype=torch.int64)


def cu_seqlens(lens: list[int], device: torch.device | str) -> torch.Tensor:  # [B+1] int32
    out = torch.zeros(len(lens) + 1, dtype=torch.int32, device=device)
    out[1:] = torch.tensor(lens, dtype=torch.int32, device=device).cumsum(0)
    return out


def v_pages_transposed(kv: PagedKV) -> torch.Tensor:
    """`kv.v_cache` with each page stored [Hkv, D, page_size] (a page's keys contiguous for
    each channel), returned with the pool's [slots, Hkv, D] shape over that memory. Slots of a
    request's pages past its context hold a large finite value instead of NaN (such a pool is
    finite everywhere, which the transposed-V kernels rely on: they read whole pages); spare
    pages keep their poison."""
    v = kv.v_cache.clone()
    ps = kv.page_size
    used = torch.zeros(v.shape[0] // ps, dtype=torch.bool, device=v.device)
    for i, n in enumerate(kv.seq_lens_host):
        used[kv.block_table[i, : -(-n // ps)].long()] = True
    slot_used = used.repeat_interleave(ps)
    bits = v.view(torch.uint8) if v.element_size() == 1 else None
    if bits is not None:  # e4m3: NaN is 0x7F / 0xFF; 0x7E is 448
        nan = (bits & 0x7F) == 0x7F
        bits[nan & slot_used[:, None, None]] = 0x7E
    else:
        v[v.isnan() & slot_used[:, None, None]] = 1e4
    pages, hkv, d = v.shape[0] // ps, v.shape[1], v.shape[2]
    return v.view(pages, ps, hkv, d).permute(0, 2, 3, 1).contiguous().view(v.shape)
