"""Random paged KV batches for kernel tests and benchmarks (pure torch, no Triton)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.kernels.attention.reference import context_slots
from minisgl.kernels.fp8 import is_fp8, quantize_kv, v_pages


@dataclass
class PagedKV:
    """One layer's KV pool holding a batch of requests on randomly scattered pages."""

    k_cache: torch.Tensor  # [num_pages * page_size, Hkv, D]
    v_cache: torch.Tensor  # the same; an e4m3 pool's [num_pages, Hkv, D, page_size] (`KVPool`)
    block_table: torch.Tensor  # [B, P] int32 page ids
    seq_lens: torch.Tensor  # [B] int32
    seq_lens_host: list[int]
    page_size: int
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None  # FP8 pools: [Hkv] fp32 each

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host, default=0)


def random_paged_kv(
    seq_lens: list[int], page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    device: torch.device | str,
    *,
    spare_pages: int = 2,
    poison: bool = True,
) -> PagedKV:  # fmt: skip
    """Requests get disjoint pages in random order. With `poison`, every slot outside the
    contexts holds NaN, so a kernel that reads outside a context produces NaN (else the pool is
    all random: cheap for huge pools). An e4m3 pool comes with per-KV-head scales and V in its
    pages-transposed layout, whose kernels read whole pages: there the tails of context pages
    hold 448 instead (finite, as in a real pool, and loud if weighed)."""
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
    shape: tuple[int, int, int], table: torch.Tensor, lens: torch.Tensor, seq_lens: list[int],
    page_size: int, poison: bool,
) -> PagedKV:  # fmt: skip
    """e4m3 pools of normal values with a magnitude per KV head, quantized with 8 sigma of
    headroom, filled a chunk of slots at a time (a benchmark's pool has billions of values)."""
    device = table.device
    caches: list[torch.Tensor] = []
    scales: list[torch.Tensor] = []
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
            bits = cache.view(torch.uint8)
            if caches:  # V: whole pages are read, so their tails are finite (448: loud if used)
                in_pages = _slots_of_used_pages(table, seq_lens, page_size, shape[0])
                bits[~keep & in_pages] = 0x7E
                keep |= in_pages
            bits[~keep] = 0x7F  # e4m3 NaN (no masked_fill for e4m3)
        caches.append(cache)
        scales.append(scale)
    by_slot = caches[1].view(torch.uint8).view(-1, page_size, *shape[1:])
    v = v_pages(caches[1], page_size)  # an FP8 pool's V layout (`KVPool`), in place
    v.view(torch.uint8).copy_(by_slot.permute(0, 2, 3, 1).clone())
    return PagedKV(caches[0], v, table, lens, seq_lens, page_size, (scales[0], scales[1]))


def _slots_of_used_pages(
    table: torch.Tensor, seq_lens: list[int], page_size: int, num_slots: int
) -> torch.Tensor:  # [num_slots] bool: the slot's page holds part of some request's context
    used = torch.zeros(num_slots // page_size, dtype=torch.bool, device=table.device)
    for i, n in enumerate(seq_lens):
        used[table[i, : -(-n // page_size)].long()] = True
    return used.repeat_interleave(page_size)


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
