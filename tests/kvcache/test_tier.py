"""The host and disk tiers under the radix cache, as a state machine over a tiny device pool:
requests start (their prefix matched on the device, then loaded back from host or disk), are
computed, finish or are aborted with their loads still queued; the cache evicts (writing back)
and is flushed. After every step, every page the device cache or the host holds has exactly the
K/V bytes of its token ids (compared with a recompute), and the three tiers' accounting holds."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minisgl.core import Req, SamplingParams, pages_for
from minisgl.engine.kv_tier import TierCopier
from minisgl.kvcache import HostTier, KVPool, PageAllocator, SlotAllocator, make_prefix_cache
from minisgl.kvcache.tier import page_keys
from minisgl.scheduler import KVManager

DEVICE_PAGES, HOST_PAGES, DISK_PAGES = 6, 3, 8
# Pages of tokens to build prompts from: few, so prefixes collide.
PATTERNS = {1: [(0,), (1,), (2,)], 2: [(0, 0), (0, 1), (1, 1)]}


def kv_bytes(ids: tuple[int, ...], page_bytes: int) -> torch.Tensor:
    """What a model would store for the last page of `ids`: a function of every id up to it
    (the 'recompute' each page is compared with)."""
    gen = torch.Generator().manual_seed(hash(ids) % (1 << 62))
    return torch.randint(0, 256, (page_bytes,), dtype=torch.uint8, generator=gen)


class TierMachine(RuleBasedStateMachine):
    PAGE_SIZE = 1

    def __init__(self) -> None:
        super().__init__()
        ps = self.PAGE_SIZE
        self.pool = KVPool(2, DEVICE_PAGES, ps, 2, 4, torch.float32, torch.device("cpu"))
        self.disk = tempfile.mkdtemp(prefix="kv-tier-")
        path = str(Path(self.disk) / "rank0.pages")
        self.copier = TierCopier(self.pool, HOST_PAGES, path, DISK_PAGES)
        self.tier = HostTier(ps, HOST_PAGES, DISK_PAGES)
        cache = make_prefix_cache("radix", ps, self.tier)
        alloc, slots = PageAllocator(DEVICE_PAGES), SlotAllocator(3)
        self.kv = KVManager(alloc, slots, cache, ps, debug=True, tier=self.tier)
        self.running: list[Req] = []
        self.step = 0
        self.prefixes: dict[object, tuple[int, ...]] = {}  # page key -> its ids (to check)

    def teardown(self) -> None:
        self.copier.close()
        shutil.rmtree(self.disk)

    # ---- helpers -------------------------------------------------------------------------

    def ids(self, picks: list[int]) -> list[int]:
        out = [t for i in picks for t in PATTERNS[self.PAGE_SIZE][i]]
        return out + [9]  # one token past the pages: attach leaves it to compute

    def remember(self, ids: list[int]) -> None:
        ps = self.PAGE_SIZE
        for i, key in enumerate(page_keys(ids, ps, len(ids) // ps)):
            self.prefixes[key] = tuple(ids[: (i + 1) * ps])

    def expected(self, ids: list[int], page: int) -> torch.Tensor:
        return kv_bytes(tuple(ids[: (page + 1) * self.PAGE_SIZE]), self.pool.page_bytes)

    def plan(self) -> None:
        """What a step plan carries to the engine: the copies run, in order."""
        self.step += 1
        self.kv.launched(self.step, self.running)
        *_, copies = self.kv.take_writes()
        self.copier.run(copies)
        self.kv.reclaim(self.step)

    def device_page(self, page: int) -> torch.Tensor:
        return self.pool.read_pages(torch.tensor([page]))[0]

    # ---- rules ---------------------------------------------------------------------------

    @precondition(lambda self: self.kv.slots.num_free > 0)
    @rule(picks=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def start(self, picks: list[int]) -> None:
        """Admit and compute a request; its cached prefix holds the right KV."""
        ids, ps, cache = self.ids(picks), self.PAGE_SIZE, self.kv.cache
        matched = cache.peek(ids[:-1]) // ps  # (admission's question, as the scheduler asks it)
        room = self.kv.available_pages - min(matched, cache.evictable_pages)
        if pages_for(len(ids), ps) - matched > room:
            return
        self.remember(ids)
        req = Req(f"r{self.step}", ids, SamplingParams(max_tokens=1), seed=0)
        self.kv.attach(req)
        self.kv.grow(req, len(ids))
        self.plan()
        cached = req.cache_len // self.PAGE_SIZE
        for i, page in enumerate(req.pages[:cached]):
            assert torch.equal(self.device_page(page), self.expected(ids, i)), f"page {i}"
        for i in range(cached, len(ids) // self.PAGE_SIZE):  # the model computes the rest
            data = self.expected(ids, i)[None]
            self.pool.write_pages(torch.tensor([req.pages[i]]), data)
        req.num_computed = req.num_stored = len(ids)
        self.running.append(req)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 2))
    def finish(self, i: int) -> None:
        req = self.running.pop(i % len(self.running))
        self.kv.release(req, self.step)
        self.plan()

    @precondition(lambda self: self.kv.slots.num_free > 0)
    @rule(picks=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def abort_during_load(self, picks: list[int]) -> None:
        """Attach (loads queued), then abort before the plan carrying the loads runs."""
        ids = self.ids(picks)
        self.remember(ids)
        req = Req("aborted", ids, SamplingParams(max_tokens=1), seed=0)
        self.kv.attach(req)
        self.kv.release(req, self.step)
        self.plan()

    @rule(n=st.integers(1, 4))
    def evict(self, n: int) -> None:
        self.kv._free_pages(self.kv.cache.evict(n))
        self.plan()

    @rule()
    def flush(self) -> None:
        self.kv.flush()
        self.plan()

    # ---- invariants ----------------------------------------------------------------------

    @invariant()
    def three_tiers_account(self) -> None:
        own = sum(self.kv.own_pages(r) for r in self.running)
        cache = self.kv.cache
        total = self.kv.allocator.num_free + own + cache.protected_pages + cache.evictable_pages
        assert total + self.kv.deferred_pages == DEVICE_PAGES
        self.tier.check()
        acc = self.tier.accounting()
        assert acc["host_used"] + acc["host_free"] == HOST_PAGES
        assert acc["disk_used"] + acc["disk_free"] == DISK_PAGES

    @invariant()
    def cached_pages_hold_their_ids(self) -> None:
        cache = self.kv.cache
        for node in cache._nodes():  # type: ignore[attr-defined]
            ids = cache._ids(node)  # type: ignore[attr-defined]
            first = len(ids) // self.PAGE_SIZE - len(node.pages)
            for i, page in enumerate(node.pages):
                assert torch.equal(self.device_page(page), self.expected(ids, first + i))

    @invariant()
    def host_pages_hold_their_ids(self) -> None:
        for key, slot in self.tier.host.used.items():
            ids = self.prefixes[key]
            assert torch.equal(self.copier.host[slot], kv_bytes(ids, self.pool.page_bytes))


class TierMachinePage2(TierMachine):
    PAGE_SIZE = 2


SETTINGS = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestTier = TierMachine.TestCase
TestTier.settings = SETTINGS
TestTierPage2 = TierMachinePage2.TestCase
TestTierPage2.settings = SETTINGS


def test_a_page_written_back_once_is_not_written_again() -> None:
    """Evicted, loaded back, evicted again: one write-back, one load."""
    tier = HostTier(1, 4)
    cache = make_prefix_cache("radix", 1, tier)
    kv = KVManager(PageAllocator(4), SlotAllocator(2), cache, 1, tier=tier)
    ids = [5, 6, 7]
    kv.cache.insert(ids, kv.allocator.alloc(3))
    kv._free_pages(kv.cache.evict(3))
    req = Req("r", [*ids, 8], SamplingParams(max_tokens=1), seed=0)
    kv.attach(req)
    assert req.cache_len == 3
    kv.release(req, 0)
    kv.reclaim(0)
    kv._free_pages(kv.cache.evict(3))
    kinds = [(c.kind, len(c.src)) for c in kv.take_writes()[3]]
    assert kinds == [(("device", "host"), 3), (("host", "device"), 3)]
    assert (tier.stats.saved, tier.stats.loaded) == (3, 3)


def test_the_host_lru_spills_to_disk_and_a_hit_reads_it_back() -> None:
    tier = HostTier(1, 2, disk_pages=4)
    tier.write_back([1, 2], [0, 1])  # host: both pages
    tier.write_back([3], [2])  # host full: [1]'s page goes to disk
    assert tier.accounting()["disk_used"] == 1
    assert [c.kind for c in tier.take_copies()][-2:] == [("host", "disk"), ("device", "host")]
    # [1] is read back into the host page of [1, 2], which goes down first; then [1, 2] is
    # read back into [3]'s, which goes down; [1, 2, 4] has no third page anywhere.
    assert len(tier.lookup([1, 2, 4], 0, 3)) == 2
    spill, fetch = ("host", "disk"), ("disk", "host")
    assert [c.kind for c in tier.take_copies()] == [spill, fetch, spill, fetch]
    assert tier.stats.fetched == 2 and tier.accounting()["disk_used"] == 3


def test_tier_options_that_cannot_work_are_refused() -> None:
    from minisgl.config import EngineConfig

    for bad, match in (
        ({"kv_host_gib": 1.0, "cache": "naive"}, "radix"),
        ({"kv_disk_dir": "/tmp/x"}, "under the host tier"),
        ({"kv_host_gib": -1.0}, "kv_host_gib must be >= 0"),
    ):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**bad)
