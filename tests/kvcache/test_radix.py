from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minisgl.kvcache import PageAllocator
from minisgl.kvcache.radix import RadixPrefixCache

Prefix = tuple[int, ...]


class ReferenceCache:
    """The cache as the plainest possible bookkeeping: one entry per cached whole-page prefix.

    `page[p]` is the page holding the last page of tokens of prefix `p`; the set of keys is
    closed under taking shorter prefixes. Times and lock counts are kept per prefix too.
    """

    def __init__(self, page_size: int) -> None:
        self.ps = page_size
        self.page: dict[Prefix, int] = {}
        self.locks: dict[Prefix, int] = {}
        self.time: dict[Prefix, int] = {}
        self.clock = 0

    def prefixes(self, ids: Prefix) -> list[Prefix]:
        return [ids[:i] for i in range(self.ps, len(ids) + 1, self.ps)]

    def match(self, ids: Prefix) -> list[Prefix]:
        self.clock += 1
        hit = []
        for p in self.prefixes(ids):
            if p not in self.page:
                break
            hit.append(p)
            self.time[p] = self.clock
        return hit

    def insert(self, ids: Prefix, pages: list[int]) -> list[int]:
        self.clock += 1
        returned = []
        for p, page in zip(self.prefixes(ids), pages, strict=True):
            if p not in self.page:
                self.page[p] = page
            elif self.page[p] != page:
                returned.append(page)
            self.time[p] = self.clock
        return returned

    def add_lock(self, matched: Prefix, delta: int) -> None:
        for p in self.prefixes(matched):
            self.locks[p] = self.locks.get(p, 0) + delta
            assert self.locks[p] >= 0

    def unlocked(self) -> list[Prefix]:
        return [p for p in self.page if self.locks.get(p, 0) == 0]

    def is_leaf(self, p: Prefix) -> bool:
        return not any(len(q) > len(p) and q[: len(p)] == p for q in self.page)

    def evict_page(self, page: int) -> None:
        """Check that evicting `page` now is legal and least recently used, then drop it."""
        [p] = [q for q, pg in self.page.items() if pg == page]
        assert self.locks.get(p, 0) == 0, f"evicted locked page {page}"
        assert self.is_leaf(p), f"evicted page {page} while a longer prefix still uses it"
        oldest = min(self.time[q] for q in self.unlocked() if self.is_leaf(q))
        assert self.time[p] == oldest, f"evicted page {page} is not least recently used"
        del self.page[p], self.time[p]
        self.locks.pop(p, None)


# Pages of tokens to build prompts from: few, so prefixes collide; for page size 4 the first two
# share three tokens, so matches also end inside a page.
PAGE_POOLS: dict[int, list[Prefix]] = {
    1: [(0,), (1,), (2,)],
    4: [(0, 0, 0, 0), (0, 0, 0, 1), (1, 1, 1, 1)],
}
NUM_PAGES = 24

page_picks = st.lists(st.integers(0, 2), min_size=1, max_size=5)
tails = st.lists(st.integers(0, 3), max_size=3)


class RadixMachine(RuleBasedStateMachine):
    """Random match / lock / insert / unlock / evict against `ReferenceCache`."""

    PAGE_SIZE = 1

    def __init__(self) -> None:
        super().__init__()
        self.cache = RadixPrefixCache(self.PAGE_SIZE)
        self.ref = ReferenceCache(self.PAGE_SIZE)
        self.alloc = PageAllocator(NUM_PAGES)
        self.held: list[tuple[Any, Prefix]] = []

    def ids(self, picks: list[int], tail: Sequence[int] = ()) -> Prefix:
        pool = PAGE_POOLS[self.PAGE_SIZE]
        return sum((pool[i] for i in picks), ()) + tuple(tail[: self.PAGE_SIZE - 1])

    def checked_match(self, ids: Prefix) -> tuple[Any, Prefix]:
        got = self.cache.match_prefix(ids)
        hit = self.ref.match(ids)
        assert got.length == len(hit) * self.PAGE_SIZE
        assert got.pages == [self.ref.page[p] for p in hit]
        assert (got.handle is None) == (not hit)
        return got.handle, ids[: got.length]

    def checked_evict(self, num_pages: int) -> None:
        expected = min(num_pages, len(self.ref.unlocked()))
        out = self.cache.evict(num_pages)
        assert len(out) == expected
        for page in out:
            self.ref.evict_page(page)
        self.alloc.free(out)

    def fresh_pages(self, n: int) -> list[int] | None:
        """Like the scheduler: evict only when the allocator runs short."""
        if self.alloc.num_free < n:
            self.checked_evict(n - self.alloc.num_free)
        return self.alloc.alloc(n) if self.alloc.num_free >= n else None

    @rule(picks=page_picks, tail=tails)
    def match(self, picks: list[int], tail: list[int]) -> None:
        self.checked_match(self.ids(picks, tail))

    @rule(picks=page_picks, tail=tails)
    def peek(self, picks: list[int], tail: list[int]) -> None:
        """The read-only question: the reference's times stay as they are, so the eviction
        checks fail if `peek` refreshed anything."""
        ids = self.ids(picks, tail)
        hit = 0
        for p in self.ref.prefixes(ids):
            if p not in self.ref.page:
                break
            hit += 1
        assert self.cache.peek(ids) == hit * self.PAGE_SIZE

    @rule(picks=page_picks, tail=tails)
    def match_and_lock(self, picks: list[int], tail: list[int]) -> None:
        handle, matched = self.checked_match(self.ids(picks, tail))
        self.cache.lock(handle)
        self.ref.add_lock(matched, +1)
        self.held.append((handle, matched))

    @precondition(lambda self: self.held)
    @rule(which=st.integers(0, 1000))
    def unlock(self, which: int) -> None:
        handle, matched = self.held.pop(which % len(self.held))
        self.cache.unlock(handle)
        self.ref.add_lock(matched, -1)

    @rule(picks=page_picks)
    def insert_fresh(self, picks: list[int]) -> None:
        ids = self.ids(picks)
        pages = self.fresh_pages(len(picks))
        if pages is None:
            return
        returned = self.cache.insert(ids, pages)
        assert returned == self.ref.insert(ids, pages)
        self.alloc.free(returned)

    @rule(picks=page_picks)
    def extend_matched(self, picks: list[int]) -> None:
        """A request's life: match and lock, compute the rest, insert it all, unlock."""
        ids = self.ids(picks)
        handle, matched = self.checked_match(ids)
        self.cache.lock(handle)
        self.ref.add_lock(matched, +1)
        fresh = self.fresh_pages(len(picks) - len(matched) // self.PAGE_SIZE)
        if fresh is not None:
            pages = [self.ref.page[p] for p in self.ref.prefixes(matched)] + fresh
            returned = self.cache.insert(ids, pages)
            assert returned == self.ref.insert(ids, pages) == []
        self.cache.unlock(handle)
        self.ref.add_lock(matched, -1)

    @rule(num_pages=st.integers(0, 8))
    def evict(self, num_pages: int) -> None:
        self.checked_evict(num_pages)

    @invariant()
    def accounting(self) -> None:
        unlocked = len(self.ref.unlocked())
        assert self.cache.evictable_pages == unlocked
        assert self.cache.protected_pages == len(self.ref.page) - unlocked
        cached = self.cache.evictable_pages + self.cache.protected_pages
        assert self.alloc.num_free + cached == NUM_PAGES

    def teardown(self) -> None:
        for handle, _ in self.held:
            self.cache.unlock(handle)
        self.alloc.free(self.cache.reset())
        assert self.cache.total_pages == 0
        assert self.alloc.num_free == NUM_PAGES


class RadixMachinePage4(RadixMachine):
    PAGE_SIZE = 4


MACHINE_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixPage1 = RadixMachine.TestCase
TestRadixPage1.settings = MACHINE_SETTINGS
TestRadixPage4 = RadixMachinePage4.TestCase
TestRadixPage4.settings = MACHINE_SETTINGS


# Plain examples of each rule.


def test_partial_match_splits_so_handle_names_the_match() -> None:
    cache = RadixPrefixCache(1)
    assert cache.insert([1, 2, 3, 4], [10, 11, 12, 13]) == []
    m = cache.match_prefix([1, 2, 9])
    assert (m.length, m.pages) == (2, [10, 11])
    cache.lock(m.handle)
    assert (cache.protected_pages, cache.evictable_pages) == (2, 2)
    assert cache.evict(10) == [13, 12]
    assert cache.match_prefix([1, 2, 3, 4]).pages == [10, 11]


def test_prompt_that_is_a_prefix_of_another() -> None:
    cache = RadixPrefixCache(2)
    assert cache.insert([1, 2], [0]) == []
    assert cache.insert([1, 2, 3, 4], [5, 6]) == [5]
    assert cache.insert([1, 2], [7]) == [7]
    assert cache.match_prefix([1, 2, 3, 4, 5]).pages == [0, 6]
    assert cache.match_prefix([1, 2, 3]).pages == [0]
    assert cache.evictable_pages == 2


def test_match_ending_mid_page_rounds_down() -> None:
    cache = RadixPrefixCache(4)
    cache.insert(list(range(8)), [3, 4])
    m = cache.match_prefix(list(range(7)))
    assert (m.length, m.pages) == (4, [3])
    assert cache.match_prefix([0, 1, 2, 3, 4, 5, 9, 7]).length == 4
    assert cache.match_prefix([0, 1, 2]) == (0, [], None)


def test_insert_keeps_pages_offered_back_from_a_match() -> None:
    cache = RadixPrefixCache(1)
    cache.insert([1, 2], [0, 1])
    m = cache.match_prefix([1, 2, 3])
    assert cache.insert([1, 2, 3], [*m.pages, 2]) == []
    assert cache.evictable_pages == 3


def test_eviction_is_least_recently_used_first() -> None:
    cache = RadixPrefixCache(1)
    cache.insert([1, 1], [0, 1])
    cache.insert([2, 2], [2, 3])
    cache.insert([3, 3], [4, 5])
    cache.match_prefix([1])  # splits [1, 1]; page 0 is now the newest, page 1 still the oldest
    assert cache.evict(1) == [1]
    assert cache.evict(3) == [3, 2, 5]
    assert cache.evict(10) == [4, 0]
    assert cache.evictable_pages == 0


def test_locked_path_is_never_evicted() -> None:
    cache = RadixPrefixCache(2)
    cache.insert([1, 2, 3, 4], [0, 1])
    cache.insert([1, 2, 5, 6], [2, 3])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.lock(m.handle)
    assert cache.evict(100) == [3]
    assert (cache.protected_pages, cache.evictable_pages) == (2, 0)
    cache.unlock(m.handle)
    assert sorted(cache.evict(100)) == [0, 1]


def test_unlocking_everything_makes_all_evictable() -> None:
    cache = RadixPrefixCache(1)
    cache.insert([1, 2, 3], [0, 1, 2])
    cache.insert([1, 5], [3, 4])
    handles = [cache.match_prefix(ids).handle for ids in ([1, 2, 3], [1, 2], [1, 5], [1, 2, 3])]
    for h in handles:
        cache.lock(h)
    assert (cache.protected_pages, cache.evictable_pages) == (4, 0)
    for h in handles:
        cache.unlock(h)
    assert (cache.protected_pages, cache.evictable_pages) == (0, 4)
    assert cache.total_pages == 4


def test_reset_drops_only_unlocked_entries() -> None:
    cache = RadixPrefixCache(1)
    cache.insert([1, 2, 3], [0, 1, 2])
    cache.insert([7], [3])
    m = cache.match_prefix([1, 2])
    cache.lock(m.handle)
    assert sorted(cache.reset()) == [2, 3]
    assert cache.match_prefix([1, 2, 3]).pages == [0, 1]
    cache.unlock(m.handle)
    assert sorted(cache.reset()) == [0, 1]
    assert cache.total_pages == 0
    cache.lock(None)  # an empty match needs no lock, but locking it is harmless
    cache.unlock(None)


def test_insert_rejects_misaligned_input() -> None:
    cache = RadixPrefixCache(4)
    with pytest.raises(ValueError, match="multiple of 4"):
        cache.insert([1, 2, 3], [0])
    with pytest.raises(ValueError, match="one page per 4"):
        cache.insert([1, 2, 3, 4], [0, 1])


def test_peek_neither_splits_nor_refreshes() -> None:
    cache = RadixPrefixCache(1)
    cache.insert([1, 1], [0, 1])
    cache.insert([2, 2], [2, 3])
    assert cache.peek([1, 9]) == 1 and cache.peek([2, 2, 2]) == 2 and cache.peek([3]) == 0
    # No split: evicting one page still takes the whole least recently used leaf's tail, and
    # [1, 1] is still the least recently used although it was peeked last.
    assert cache.evict(1) == [1]
    assert cache.evict(1) == [0]
