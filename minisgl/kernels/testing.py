"""Random paged KV batches for kernel tests and benchmarks (pure torch, no Triton)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return PagedKV(k_cache, v_cache, table, lens, list(seq_lens), page_size)


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
