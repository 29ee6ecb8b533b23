from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from minisgl.kvcache.base import BasePrefixCache, MatchResult


class NaiveCache(BasePrefixCache):
    """Keeps nothing: every request computes its whole prompt and frees its pages on finish."""

    def match_prefix(self, ids: Sequence[int]) -> MatchResult:
        return MatchResult(0, [], None)

    def peek(self, ids: Sequence[int]) -> int:
        return 0

    def insert(self, ids: Sequence[int], pages: Sequence[int]) -> list[int]:
        return list(pages)

    def lock(self, handle: Any) -> None:
        pass

    def unlock(self, handle: Any) -> None:
        pass

    def evict(self, num_pages: int) -> list[int]:
        return []

    @property
    def evictable_pages(self) -> int:
        return 0

    @property
    def protected_pages(self) -> int:
        return 0
