from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from minisgl.kvcache.base import BasePrefixCache, MatchResult


@dataclass(eq=False)
class _Node:
    """One edge of the tree: `key` tokens stored in `pages` (`len(key) == len(pages) * page_size`)."""

    key: list[int]
    pages: list[int]
    # None for the root and for a node that was evicted (so a stale handle is caught on lock).
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    # Number of held locks whose path runs through this node; never below a child's.
    ref: int = 0
    last_access: int = 0


class RadixPrefixCache(BasePrefixCache):
    """A page-aligned radix tree from token ids to KV pages, ref-counted, with LRU eviction.

    Every node's key is a whole number of pages, and children are indexed by their first page
    of tokens, so a lookup costs one dict probe and one page-wise comparison per node on the path.
    Handles are nodes; a handle names exactly the matched prefix (a partial match splits).
    """

    def __init__(
        self, page_size: int, on_evict: Callable[[list[int], list[int]], None] | None = None
    ) -> None:
        """`on_evict(ids, pages)` hears of every eviction before the pages come out: `pages`
        hold the last `len(pages)` pages of the whole-page prefix `ids` (a lower tier keeps
        them)."""
        if page_size < 1:
            raise ValueError(f"cache: page_size must be >= 1, got {page_size}")
        super().__init__(page_size)
        self._root = _Node(key=[], pages=[], parent=None)
        # A monotone counter instead of the wall clock keeps LRU order deterministic and strict.
        self._clock = itertools.count(1)
        self._evictable = 0
        self._protected = 0
        self._on_evict = on_evict

    def match_prefix(self, ids: Sequence[int]) -> MatchResult:
        """The longest cached whole-page prefix of `ids`; refreshes its LRU time; does not lock."""
        node, pages = self._walk(ids, touch=next(self._clock))
        return MatchResult(len(pages) * self.page_size, pages, None if node is self._root else node)

    def peek(self, ids: Sequence[int]) -> int:
        """What `match_prefix(ids).length` would be; nothing splits, nothing is touched."""
        ps = self.page_size
        node, pos = self._root, 0
        while len(ids) - pos >= ps:
            child = node.children.get(tuple(ids[pos : pos + ps]))
            if child is None:
                break
            matched = self._common_pages(child.key, ids, pos) * ps
            pos += matched
            if matched < len(child.key):
                break
            node = child
        return pos

    def insert(self, ids: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Cache `ids` -> `pages`; returns the offered pages for prefixes cached already.

        An offered page equal to the one the cache holds at that position (a request offering back
        the pages it matched) is the cache's own and is not returned.
        """
        ps = self.page_size
        if len(ids) % ps or len(pages) * ps != len(ids):
            raise ValueError(
                f"cache: insert needs len(ids) a multiple of {ps} and one page per {ps} ids, "
                f"got {len(ids)} ids and {len(pages)} pages"
            )
        now = next(self._clock)
        node, cached = self._walk(ids, touch=now)
        n = len(cached)
        if n < len(pages):
            leaf = _Node(list(ids[n * ps :]), list(pages[n:]), parent=node, last_access=now)
            node.children[self._first_page(leaf.key)] = leaf
            # Unlocked even if the inserter holds `node`: its handle ends above the new leaf, so a
            # caller still using these pages must match and lock again before unlocking.
            self._evictable += len(leaf.pages)
        return [p for p, c in zip(pages[:n], cached, strict=True) if p != c]

    def lock(self, handle: Any) -> None:
        """Protect the path from `handle` to the root until the matching `unlock`."""
        if handle is None:
            return
        assert handle.parent is not None, "lock of an evicted handle: lock right after matching"
        for node in self._path(handle):
            if node.ref == 0:
                self._move(node, to_protected=True)
            node.ref += 1

    def unlock(self, handle: Any) -> None:
        """Release one `lock(handle)`; nodes whose count drops to zero become evictable."""
        if handle is None:
            return
        for node in self._path(handle):
            assert node.ref > 0, "unlock without a matching lock"
            node.ref -= 1
            if node.ref == 0:
                self._move(node, to_protected=False)

    def evict(self, num_pages: int) -> list[int]:
        """Give back up to `num_pages` unlocked pages, least recently used leaves first.

        Pages come out deepest first, so every prefix of the result is itself a valid eviction.
        A leaf larger than what is still needed is split and only its tail is evicted.
        """
        leaves = (n for n in self._nodes() if not n.children and n.ref == 0)
        # The sequence number breaks ties without comparing nodes.
        seq = itertools.count()
        heap = [(n.last_access, next(seq), n) for n in leaves]
        heapq.heapify(heap)
        out: list[int] = []
        while heap and len(out) < num_pages:
            _, _, node = heapq.heappop(heap)
            keep = len(node.pages) - (num_pages - len(out))
            if keep > 0:
                self._split(node, keep * self.page_size)
            parent = node.parent
            assert parent is not None and node.ref == 0
            if self._on_evict is not None:
                self._on_evict(self._ids(node), node.pages)
            del parent.children[self._first_page(node.key)]
            node.parent = None
            out.extend(reversed(node.pages))
            self._evictable -= len(node.pages)
            # The parent may just have become an unlocked leaf; its time is >= the child's.
            if parent is not self._root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_access, next(seq), parent))
        return out

    @property
    def evictable_pages(self) -> int:
        return self._evictable

    @property
    def protected_pages(self) -> int:
        return self._protected

    def _walk(self, ids: Sequence[int], touch: int) -> tuple[_Node, list[int]]:
        """Follow `ids` down whole pages, splitting where a match ends inside a node."""
        ps = self.page_size
        node, pos = self._root, 0
        pages: list[int] = []
        while len(ids) - pos >= ps:
            child = node.children.get(tuple(ids[pos : pos + ps]))
            if child is None:
                break
            matched = self._common_pages(child.key, ids, pos) * ps
            if matched < len(child.key):
                # The next probe misses (or `ids` runs out), so the loop ends at the new node.
                child = self._split(child, matched)
            child.last_access = touch
            node, pos = child, pos + matched
            pages.extend(child.pages)
        return node, pages

    def _common_pages(self, key: list[int], ids: Sequence[int], pos: int) -> int:
        """Whole pages `key` shares with `ids[pos:]`; at least one, since the first page keyed it."""
        ps, n = self.page_size, 1
        while n * ps < len(key) and len(ids) - pos >= (n + 1) * ps:
            if key[n * ps : (n + 1) * ps] != list(ids[pos + n * ps : pos + (n + 1) * ps]):
                break
            n += 1
        return n

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut `node` after `at` tokens; returns the new upper part, which inherits refs and time.

        `node` keeps its identity as the lower part, so handles naming it stay valid.
        """
        parent = node.parent
        assert parent is not None and 0 < at < len(node.key) and at % self.page_size == 0
        upper = _Node(key=node.key[:at], pages=node.pages[: at // self.page_size], parent=parent)
        upper.ref, upper.last_access = node.ref, node.last_access
        parent.children[self._first_page(upper.key)] = upper
        node.key, node.pages, node.parent = node.key[at:], node.pages[at // self.page_size :], upper
        upper.children[self._first_page(node.key)] = node
        return upper

    def _move(self, node: _Node, to_protected: bool) -> None:
        n = len(node.pages) if to_protected else -len(node.pages)
        self._protected += n
        self._evictable -= n

    def _path(self, node: _Node) -> list[_Node]:
        path = []
        while node is not self._root:
            path.append(node)
            assert node.parent is not None
            node = node.parent
        return path

    def _ids(self, node: _Node) -> list[int]:
        """The token ids from the root to the end of `node`."""
        return [t for n in reversed(self._path(node)) for t in n.key]

    def _nodes(self) -> list[_Node]:
        stack, out = list(self._root.children.values()), []
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _first_page(self, key: Sequence[int]) -> tuple[int, ...]:
        return tuple(key[: self.page_size])


class NaiveCache(RadixPrefixCache):
    """Keeps nothing: every request computes its whole prompt and frees its pages on finish
    (every offer comes back, so the tree stays empty and every match is empty)."""

    def insert(self, ids: Sequence[int], pages: Sequence[int]) -> list[int]:
        return list(pages)
