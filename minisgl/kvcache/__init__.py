"""Paged KV storage, page allocation, the request table and prefix caches."""

from minisgl.kvcache.allocator import OutOfPagesError, PageAllocator, SlotAllocator
from minisgl.kvcache.base import BasePrefixCache, MatchResult
from minisgl.kvcache.naive import NaiveCache
from minisgl.kvcache.pool import KVPool
from minisgl.kvcache.table import ReqTable

CACHE_KINDS = ("radix", "naive")


def make_prefix_cache(kind: str, page_size: int) -> BasePrefixCache:
    if kind == "naive":
        return NaiveCache(page_size)
    if kind == "radix":
        from minisgl.kvcache.radix import RadixPrefixCache

        return RadixPrefixCache(page_size)
    raise ValueError(f"cache: unknown kind {kind!r}; choose one of {CACHE_KINDS}")


__all__ = [
    "CACHE_KINDS",
    "BasePrefixCache",
    "KVPool",
    "MatchResult",
    "NaiveCache",
    "OutOfPagesError",
    "PageAllocator",
    "ReqTable",
    "SlotAllocator",
    "make_prefix_cache",
]
