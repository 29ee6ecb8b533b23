"""Page and slot bookkeeping for running requests: admission with prefix matches, growth,
release, and the request-table writes that the next step plan carries to the engine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from minisgl.core import PageCopy, Req, SeqInfo, TableWrite, pages_for
from minisgl.kvcache import BasePrefixCache, HostTier, MatchResult, PageAllocator, SlotAllocator


@dataclass
class _Deferred:
    """What a released request held, kept until the last step that may read it completes."""

    step: int  # the last step launched when the request let go
    pages: list[int]  # its own pages, back to the allocator
    slot: int | None
    handle: Any  # its prefix-cache lock, released then (the cached pages become evictable)


@dataclass
class _StepRefs:
    """Slots and pages a launched step reads or writes (the KV debug mode checks frees)."""

    slots: set[int] = field(default_factory=set)
    pages: set[int] = field(default_factory=set)


class KVManager:
    """Moves pages between the allocator, the prefix cache and requests; slots likewise.

    A running request's `pages` cover its tokens in order; the first `cache_len // page_size`
    belong to the prefix cache (locked by `cache_handle`), the rest are its own.

    Steps are numbered by the scheduler in launch order. Nothing a step may still read or write
    is reused before that step has completed on the device: a released request's pages, slot
    and cache lock wait in `_deferred` until `reclaim` hears that the last step launched before
    the release completed, and a page joins the prefix cache (where another request can match
    it) only once the step that wrote it completed (`Req.num_stored`). Device tables are never
    written here: the writes queue up for the next step plan (`take_writes`).

    `tier` (the host tier, `minisgl.kvcache.tier`): the cache's evictions are written back to
    it (its `write_back` hook on the cache), and a request attached with a prefix that goes on
    below the device gets device pages for it, loaded back by copies its first step plan
    carries ahead of the step's kernels; the loaded pages join the prefix cache at once.

    `debug` (the KV debug mode): every launched step's slots and pages are recorded, a page or
    slot given back while a step in flight references it fails an assertion, pages given
    back are listed for the engine to poison, and every plan checks the tiers' slots.
    """

    def __init__(
        self,
        allocator: PageAllocator,
        slots: SlotAllocator,
        cache: BasePrefixCache,
        page_size: int,
        debug: bool = False,
        tier: HostTier | None = None,
    ) -> None:
        self.allocator = allocator
        self.tier = tier
        self.slots = slots
        self.cache = cache
        self.page_size = page_size
        self.debug = debug
        self._deferred: list[_Deferred] = []
        self._page_writes: list[TableWrite] = []
        self._token_writes: list[TableWrite] = []
        self._freed: list[int] = []  # pages back in the allocator since the last plan (debug)
        self._in_flight: dict[int, _StepRefs] = {}  # debug: launched, not yet completed steps
        self._loaded: set[int] = set()  # pages the next plan loads (not poisoned: debug)

    @property
    def available_pages(self) -> int:
        """Pages an allocation can get now: free ones plus those the cache can evict."""
        return self.allocator.num_free + self.cache.evictable_pages

    @property
    def has_deferred(self) -> bool:
        """Whether anything released waits for a step in flight (pages, a slot, a lock)."""
        return bool(self._deferred)

    @property
    def deferred_pages(self) -> int:
        return sum(len(d.pages) for d in self._deferred)

    def own_pages(self, req: Req) -> int:
        return len(req.pages) - req.cache_len // self.page_size

    # ---- requests --------------------------------------------------------------------------

    def attach(self, req: Req) -> None:
        """Give a waiting request a slot and its cached prefix (at least one token is left to
        compute, so the step that finishes its prefill produces logits)."""
        ids = req.all_ids()
        match = self.cache.match_prefix(ids[: len(ids) - 1])
        self.cache.lock(match.handle)
        if self.tier is not None:
            match = self._load_from_tier(ids[: len(ids) - 1], match)
        slot = self.slots.alloc(1)[0]
        req.seq = SeqInfo(slot, req.params, req.seed, req.prompt_len, req.stop_ids)
        req.cache_handle, req.cache_len = match.handle, match.length
        req.pages = list(match.pages)
        req.num_computed = req.num_stored = match.length
        self._token_writes.append(TableWrite(slot, 0, ids))
        self._page_writes.append(TableWrite(slot, 0, list(req.pages)))

    def _load_from_tier(self, ids: list[int], match: MatchResult) -> MatchResult:
        """Extend a locked device match by the pages the host tier holds after it: device pages
        for them (as far as there is room), loads queued, the pages inserted into the cache;
        returns the longer match, locked instead of `match`."""
        assert self.tier is not None
        ps, start = self.page_size, len(match.pages)
        hits = self.tier.lookup(ids, start, len(ids) // ps)
        n = min(len(hits), self.allocator.num_free + self.cache.evictable_pages)
        self.tier.unpin(hits[n:])
        if n == 0:
            return match
        pages = self._alloc(n)  # (evictions first: their write-backs run before the loads)
        self.tier.load(hits[:n], pages)
        self._loaded.update(pages)
        end = (start + n) * ps
        returned = self.cache.insert(ids[:end], match.pages + pages)
        assert not returned, "pages past a device match were cached"
        longer = self.cache.match_prefix(ids[:end])
        self.cache.lock(longer.handle)
        self.cache.unlock(match.handle)
        return longer

    def prefetch(self, reqs: list[Req]) -> None:
        """Requests just queued: read the pages of their prefixes that sit on disk back into
        host memory now (copies in the next plan), and refresh the host's LRU for the rest, so
        that admission finds them on the host."""
        if self.tier is None:
            return
        for req in reqs:
            ids = req.all_ids()[: req.seq_len - 1]
            start = self.cache.peek(ids) // self.page_size
            self.tier.unpin(self.tier.lookup(ids, start, len(ids) // self.page_size))

    def _alloc(self, n: int) -> list[int]:
        """`n` pages, evicting from the cache what the free ones lack (caller checked room)."""
        if n > self.allocator.num_free:
            self._free_pages(self.cache.evict(n - self.allocator.num_free))
        return self.allocator.alloc(n)

    def grow(self, req: Req, tokens: int) -> None:
        """Make sure `req` has pages for its first `tokens` tokens (caller checked room)."""
        need = pages_for(tokens, self.page_size) - len(req.pages)
        if need <= 0:
            return
        new = self._alloc(need)
        assert req.slot is not None
        self._page_writes.append(TableWrite(req.slot, len(req.pages), new))
        req.pages.extend(new)

    def write_tokens(self, req: Req, start: int, ids: list[int]) -> None:
        """Queue token ids for cells `start ..` of the request's token row (drafts to verify)."""
        assert req.slot is not None
        self._token_writes.append(TableWrite(req.slot, start, ids))

    def shrink(self, req: Req, tokens: int, last_step: int) -> None:
        """`req` keeps pages for its first `tokens` tokens only (rejected drafts rolled back):
        its own pages past them come back once step `last_step` has completed."""
        keep = max(pages_for(tokens, self.page_size), req.cache_len // self.page_size)
        extra = req.pages[keep:]
        if extra:
            self._deferred.append(_Deferred(last_step, extra, None, None))
            del req.pages[keep:]

    def cache_prefix(self, req: Req, last_step: int) -> None:
        """Offer the request's stored whole pages to the prefix cache and switch to the cache's
        copies, so a later request with the same prefix can share them. Pages of ours that the
        cache already held a copy of are given back once `last_step` (which may read them
        through the request's current table row) has completed."""
        ps = self.page_size
        aligned = req.num_stored // ps * ps
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
        if dupes:
            self._deferred.append(_Deferred(last_step, dupes, None, None))
        req.pages[: match.length // ps] = match.pages
        assert req.slot is not None
        self._page_writes.append(TableWrite(req.slot, start, req.pages[start : match.length // ps]))
        req.cache_handle, req.cache_len = match.handle, match.length

    def release(self, req: Req, last_step: int) -> None:
        """`req` lets go of everything: its stored whole pages stay in the cache; its own pages,
        its slot and its cache lock come back once step `last_step` has completed."""
        self.cache_prefix(req, last_step)
        own = req.pages[req.cache_len // self.page_size :]
        self._deferred.append(_Deferred(last_step, own, req.slot, req.cache_handle))
        req.seq, req.cache_handle, req.cache_len, req.pages = None, None, 0, []
        req.num_computed = req.num_stored = 0

    def flush(self) -> int:
        """Empty the prefix cache of every entry no request holds; returns the pages freed."""
        pages = self.cache.reset()
        self._free_pages(pages)
        if self.tier is not None:
            self.tier.clear()
        return len(pages)

    # ---- steps -----------------------------------------------------------------------------

    def launched(self, step: int, reqs: list[Req]) -> None:
        """Step `step` was launched over `reqs` (debug mode: remember what it references)."""
        if self.debug:
            refs = _StepRefs({r.slot for r in reqs if r.slot is not None})
            for r in reqs:
                refs.pages.update(r.pages)
            self._in_flight[step] = refs

    def reclaim(self, completed: int) -> None:
        """Steps up to `completed` have completed: give back what waited for them."""
        for s in [s for s in self._in_flight if s <= completed]:
            del self._in_flight[s]
        keep = []
        for d in self._deferred:
            if d.step > completed:
                keep.append(d)
                continue
            self._free_pages(d.pages)
            if d.slot is not None:
                self._check_unused(slots=[d.slot])
                self.slots.free([d.slot])
            self.cache.unlock(d.handle)
        self._deferred = keep

    def take_writes(
        self,
    ) -> tuple[list[TableWrite], list[TableWrite], list[int], list[PageCopy]]:
        """The page writes, token writes, freed pages (less those the plan loads again) and
        tier copies the next step plan carries."""
        freed = [p for p in self._freed if p not in self._loaded]
        copies = [] if self.tier is None else self.tier.take_copies()
        if self.debug and self.tier is not None:
            self.tier.check()  # (the device pages: `Scheduler.check_invariants`)
        out = (self._page_writes, self._token_writes, freed, copies)
        self._page_writes, self._token_writes, self._freed = [], [], []
        self._loaded = set()
        return out

    def _free_pages(self, pages: list[int]) -> None:
        if not pages:
            return
        self._check_unused(pages=pages)
        self.allocator.free(pages)
        if self.debug:
            self._freed.extend(pages)

    def _check_unused(self, slots: Sequence[int] = (), pages: Sequence[int] = ()) -> None:
        if not self.debug:
            return
        for step, refs in self._in_flight.items():
            assert not refs.slots.intersection(slots), f"slot {slots} freed while step {step} runs"
            bad = refs.pages.intersection(pages)
            assert not bad, f"pages {sorted(bad)} freed while step {step} runs"
