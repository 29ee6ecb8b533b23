from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, NamedTuple


class MatchResult(NamedTuple):
    """A cached prefix of a token sequence.

    `length` is a multiple of the page size; `pages` are its `length // page_size` KV pages, in
    order. `handle` names the matched node for `lock` / `unlock`.
    """

    length: int
    pages: list[int]
    handle: Any


class BasePrefixCache(ABC):
    """Keeps KV pages of finished (and partly computed) sequences for reuse by later requests.

    Ownership: the cache owns every page it was given by `insert` and did not give back (by
    `insert`'s return value or `evict`). A page the cache owns is *protected* while some handle
    locking it is held, *evictable* otherwise.

    Locking: `match_prefix` does not lock (it may split entries and refreshes their recency;
    `peek` only reads). A caller that keeps using the matched pages must
    `lock(handle)` before anything can call `evict`, and `unlock(handle)` exactly once when done
    (finish, abort or retraction). Locking a handle protects the whole path to the root.

    Invariant the scheduler checks after every step:
    allocator free + pages owned by live requests + protected + evictable == total pages.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size

    @abstractmethod
    def match_prefix(self, ids: Sequence[int]) -> MatchResult:
        """The longest cached page-aligned prefix of `ids`."""

    @abstractmethod
    def peek(self, ids: Sequence[int]) -> int:
        """The length `match_prefix(ids)` would return, changing nothing: no node is split and
        no entry's recency refreshed (admission asks this of requests it may not admit)."""

    @abstractmethod
    def insert(self, ids: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Offer the pages holding `ids` (`len(ids)` a multiple of the page size).

        Returns the offered pages the cache did not keep; the caller still owns those and must
        free them (or keep using them). Pages for a prefix already cached are returned, since
        the cache keeps its own copy.
        """

    @abstractmethod
    def lock(self, handle: Any) -> None: ...

    @abstractmethod
    def unlock(self, handle: Any) -> None: ...

    @abstractmethod
    def evict(self, num_pages: int) -> list[int]:
        """Give back up to `num_pages` evictable pages (least recently used first)."""

    @property
    @abstractmethod
    def evictable_pages(self) -> int: ...

    @property
    @abstractmethod
    def protected_pages(self) -> int: ...

    @property
    def total_pages(self) -> int:
        return self.evictable_pages + self.protected_pages

    def reset(self) -> list[int]:
        """Drop every unlocked entry; returns the freed pages."""
        return self.evict(self.evictable_pages)
