"""Page bookkeeping for running requests: admission with prefix matches, growth, release."""

from __future__ import annotations

from minisgl.core import Req
from minisgl.kvcache import BasePrefixCache, PageAllocator, ReqTable


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class KVManager:
    """Moves pages between the allocator, the prefix cache and requests.

    A running request's `pages` cover its tokens in order; the first `cache_len // page_size`
    belong to the prefix cache (locked by `cache_handle`), the rest are its own.
    """

    def __init__(self, allocator: PageAllocator, cache: BasePrefixCache, table: ReqTable) -> None:
        self.allocator = allocator
        self.cache = cache
        self.table = table
        self.page_size = table.page_size

    @property
    def available_pages(self) -> int:
        """Pages an allocation can get now: free ones plus those the cache can evict."""
        return self.allocator.num_free + self.cache.evictable_pages

    def own_pages(self, req: Req) -> int:
        return len(req.pages) - req.cache_len // self.page_size

    def attach(self, req: Req) -> None:
        """Give a waiting request a slot and its cached prefix (at least one token is left to
        compute, so the step that finishes its prefill produces logits)."""
        ids = req.all_ids()
        match = self.cache.match_prefix(ids[: len(ids) - 1])
        self.cache.lock(match.handle)
        req.slot = self.table.alloc_slot()
        req.cache_handle, req.cache_len = match.handle, match.length
        req.pages = list(match.pages)
        req.num_computed = match.length
        self.table.write_tokens(req.slot, 0, ids)
        self.table.write_pages(req.slot, 0, req.pages)

    def grow(self, req: Req, tokens: int) -> None:
        """Make sure `req` has pages for its first `tokens` tokens (caller checked room)."""
        need = pages_for(tokens, self.page_size) - len(req.pages)
        if need <= 0:
            return
        if need > self.allocator.num_free:
            self.allocator.free(self.cache.evict(need - self.allocator.num_free))
        new = self.allocator.alloc(need)
        assert req.slot is not None
        self.table.write_pages(req.slot, len(req.pages), new)
        req.pages.extend(new)

    def cache_prefix(self, req: Req) -> None:
        """Offer the request's computed whole pages to the prefix cache and switch to the
        cache's copies, so a later request with the same prefix can share them."""
        ps = self.page_size
        aligned = req.num_computed // ps * ps
        if aligned <= req.cache_len:
            return
        ids = req.all_ids()[:aligned]
        start = req.cache_len // ps
        returned = set(self.cache.insert(ids, req.pages[: aligned // ps]))
        match = self.cache.match_prefix(ids)
        self.cache.lock(match.handle)
        self.cache.unlock(req.cache_handle)
        # Where the cache kept another request's copy of a page, drop ours and use that one.
        dupes = [p for p in req.pages[start : match.length // ps] if p in returned]
        self.allocator.free(dupes)
        req.pages[: match.length // ps] = match.pages
        assert req.slot is not None
        self.table.write_pages(req.slot, start, req.pages[start : match.length // ps])
        req.cache_handle, req.cache_len = match.handle, match.length

    def release(self, req: Req) -> None:
        """Give back everything `req` holds; its computed whole pages stay in the cache."""
        self.cache_prefix(req)
        self.allocator.free(req.pages[req.cache_len // self.page_size :])
        self.cache.unlock(req.cache_handle)
        if req.slot is not None:
            self.table.free_slot(req.slot)
        req.slot, req.cache_handle, req.cache_len, req.pages = None, None, 0, []
        req.num_computed = 0
