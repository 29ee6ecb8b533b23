"""Paged KV storage, page allocation, the request table and prefix caches."""

from minisgl.kvcache.allocator import PageAllocator, SlotAllocator
from minisgl.kvcache.base import BasePrefixCache, MatchResult
from minisgl.kvcache.pool import KVPool
from minisgl.kvcache.radix import NaiveCache, RadixPrefixCache
from minisgl.kvcache.table import ReqTable
from minisgl.kvcache.tier import HostTier


def make_prefix_cache(kind: str, page_size: int, tier: HostTier | None = None) -> BasePrefixCache:
    """`kind`: "radix" or "naive" (`EngineConfig.cache`, checked there); `tier`: the host tier
    that keeps what the radix cache evicts (the config refuses one under a naive cache)."""
    if kind == "naive":
        assert tier is None
        return NaiveCache(page_size)
    return RadixPrefixCache(page_size, None if tier is None else tier.write_back)


__all__ = [
    "BasePrefixCache",
    "HostTier",
    "KVPool",
    "MatchResult",
    "PageAllocator",
    "ReqTable",
    "SlotAllocator",
    "make_prefix_cache",
]
