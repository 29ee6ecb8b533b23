"""Paged KV storage, page allocation, the request table and prefix caches."""

from minisgl.kvcache.allocator import OutOfPagesError, PageAllocator, SlotAllocator
from minisgl.kvcache.base import BasePrefixCache, MatchResult
from minisgl.kvcache.naive import NaiveCache
from minisgl.kvcache.pool import KVPool
from minisgl.kvcache.table import ReqTable
from minisgl.kvcache.tier import HostTier, TierStats

CACHE_KINDS = ("radix", "naive")


def make_prefix_cache(kind: str, page_size: int, tier: HostTier | None = None) -> BasePrefixCache:
    """`tier`: the host tier that keeps what the radix cache evicts (radix only)."""
    if kind == "naive":
        if tier is not None:
            raise ValueError("kv host tier: needs --cache radix")
        return NaiveCache(page_size)
    if kind == "radix":
        from minisgl.kvcache.radix import RadixPrefixCache

        return RadixPrefixCache(page_size, None if tier is None else tier.write_back)
    raise ValueError(f"cache: unknown kind {kind!r}; choose one of {CACHE_KINDS}")


__all__ = [
    "CACHE_KINDS",
    "BasePrefixCache",
    "HostTier",
    "KVPool",
    "MatchResult",
    "NaiveCache",
    "OutOfPagesError",
    "PageAllocator",
    "ReqTable",
    "SlotAllocator",
    "TierStats",
    "make_prefix_cache",
]
