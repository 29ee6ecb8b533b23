"""The host (and disk) tier under the radix cache: where evicted device pages go, and where a
match that runs past the device's pages finds the rest.

Pure host-side bookkeeping, like the allocator: which host page (and disk slot) holds which page
of which prefix, an LRU per tier, and the copies that move pages, queued as `PageCopy` for the
next step plan (the engine runs them in order, before the step's kernels). Tensor-parallel
ranks run the same schedule, so they agree on what is resident without talking: residency is a
function of the schedule alone, and each rank's engine copies its own shard.

A page is known by its key: its own token ids and a hash of every page before it (`page_keys`),
so a tier holds pages independently of the tree's shape, and a page written back once keeps its
host copy (a page loaded back and evicted again is not written twice).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from minisgl.core import PageCopy

# (hash of the previous page's key, this page's token ids). Python hashes tuples of ints the
# same in every process (only str / bytes hashing is salted), so ranks compute the same keys.
PageKey = tuple[int, tuple[int, ...]]
DEVICE, HOST, DISK = "device", "host", "disk"


def page_keys(ids: Sequence[int], page_size: int, stop: int) -> list[PageKey]:
    """The keys of the first `stop` whole pages of `ids`."""
    keys: list[PageKey] = []
    prev = 0
    for i in range(stop):
        key = (prev, tuple(ids[i * page_size : (i + 1) * page_size]))
        keys.append(key)
        prev = hash(key)
    return keys


class _Slots:
    """`num` page slots of one tier, least recently used first out."""

    def __init__(self, num: int) -> None:
        self.num = num
        self.free = list(range(num - 1, -1, -1))
        self.used: OrderedDict[PageKey, int] = OrderedDict()

    def get(self, key: PageKey) -> int | None:
        slot = self.used.get(key)
        if slot is not None:
            self.used.move_to_end(key)
        return slot

    def take(self, key: PageKey, pinned: set[int]) -> tuple[int, PageKey | None] | None:
        """A slot for `key` (a free one, else the least recently used one not pinned, whose key
        comes back to be moved down a tier); None if every slot is pinned."""
        dropped = None
        if self.free:
            slot = self.free.pop()
        else:
            dropped = next((k for k, s in self.used.items() if s not in pinned), None)
            if dropped is None:
                return None
            slot = self.used.pop(dropped)
        self.used[key] = slot
        return slot, dropped

    def clear(self) -> None:
        self.free = list(range(self.num - 1, -1, -1))
        self.used.clear()


@dataclass
class TierStats:
    """Pages since start: written back to the host, loaded back to the device (the tier's hits,
    each a page not computed again), spilled to disk, read back from disk (the disk's hits)."""

    saved: int = 0
    loaded: int = 0
    spilled: int = 0
    fetched: int = 0


class HostTier:
    """Host pages (and optionally disk slots) under the device's radix cache.

    `write_back` takes the pages the radix cache evicts (before the allocator reuses them: the
    copy is queued ahead of anything a later plan writes into them); `lookup` finds how far a
    prefix continues below the device and returns host pages to load (pinned until `load`
    queues their copies to device pages the caller allocated). The host keeps an LRU of its own;
    pages it drops go to disk when there is a disk tier (an LRU of its own as well), else they
    are gone. The engine runs the queued copies in order, each tier's slot reused only after
    the copies queued before it.
    """

    def __init__(self, page_size: int, host_pages: int, disk_pages: int = 0) -> None:
        if host_pages < 1:
            raise ValueError(f"kv host tier: needs at least one page, got {host_pages}")
        self.page_size = page_size
        self.host = _Slots(host_pages)
        self.disk = _Slots(disk_pages)
        self.stats = TierStats()
        self._pinned: set[int] = set()  # host pages a lookup returned, not yet loaded
        self._copies: list[PageCopy] = []

    def write_back(self, ids: Sequence[int], pages: Sequence[int]) -> None:
        """The device is giving back `pages`, which hold the last `len(pages)` pages of `ids`
        (a whole-page prefix): copy those the host does not hold yet."""
        keys = page_keys(ids, self.page_size, len(ids) // self.page_size)[-len(pages) :]
        for key, page in zip(keys, pages, strict=True):
            if self.host.get(key) is not None:
                continue
            slot = self._host_slot(key)
            if slot is not None:
                self._queue((DEVICE, HOST), page, slot)
                self.stats.saved += 1

    def lookup(self, ids: Sequence[int], start: int, stop: int) -> list[int]:
        """Host pages holding pages `start .. stop` of `ids`, as far as the tiers hold them
        without a gap (a page on disk is read back into a host page first). They stay pinned
        until `load` (or `unpin`)."""
        keys = page_keys(ids, self.page_size, stop)[start:]
        out: list[int] = []
        for key in keys:
            slot = self.host.get(key)
            if slot is None:
                slot = self._fetch(key)
            if slot is None:
                break
            self._pinned.add(slot)
            out.append(slot)
        return out

    def load(self, slots: Sequence[int], pages: Sequence[int]) -> None:
        """Queue copies of host `slots` into device `pages` (from `lookup`), unpinning them."""
        for slot, page in zip(slots, pages, strict=True):
            self._queue((HOST, DEVICE), slot, page)
        self.stats.loaded += len(pages)
        self.unpin(slots)

    def unpin(self, slots: Sequence[int]) -> None:
        self._pinned.difference_update(slots)

    def take_copies(self) -> list[PageCopy]:
        """The copies queued since the last call, in the order they must run."""
        out, self._copies = self._copies, []
        return out

    def clear(self) -> None:
        """Forget every page (a flushed cache). Copies already queued still run, in order."""
        self.host.clear()
        self.disk.clear()
        self._pinned.clear()

    def accounting(self) -> dict[str, int]:
        out = {}
        for name, tier in ((HOST, self.host), (DISK, self.disk)):
            out[f"{name}_used"], out[f"{name}_free"] = len(tier.used), len(tier.free)
            out[f"{name}_total"] = tier.num
        return out

    def check(self) -> None:
        """Each tier's used and free slots are its slots, each once."""
        for tier in (self.host, self.disk):
            slots = sorted([*tier.used.values(), *tier.free])
            assert slots == list(range(tier.num)), f"kv tier slots leaked or doubled: {slots}"

    def _host_slot(self, key: PageKey, keep_disk: int | None = None) -> int | None:
        """A host page for `key`, the least recently used one moved to disk if need be (not
        into disk slot `keep_disk`, which a copy queued next reads)."""
        got = self.host.take(key, self._pinned)
        if got is None:
            return None
        slot, dropped = got
        if dropped is not None and self.disk.num and self.disk.get(dropped) is None:
            disk = self.disk.take(dropped, set() if keep_disk is None else {keep_disk})
            if disk is not None:  # (else the page is dropped: one disk slot, and it is read)
                self._queue((HOST, DISK), slot, disk[0])
                self.stats.spilled += 1
        return slot

    def _fetch(self, key: PageKey) -> int | None:
        """Read `key`'s page from disk into a host page (it keeps its disk copy)."""
        disk = self.disk.get(key)
        if disk is None:
            return None
        slot = self._host_slot(key, keep_disk=disk)
        if slot is None:
            return None
        self._queue((DISK, HOST), disk, slot)
        self.stats.fetched += 1
        return slot

    def _queue(self, kind: tuple[str, str], src: int, dst: int) -> None:
        """Append one page's copy, merged into the last copy when it is of the same kind."""
        if self._copies and self._copies[-1].kind == kind:
            self._copies[-1].src.append(src)
            self._copies[-1].dst.append(dst)
        else:
            self._copies.append(PageCopy(kind, [src], [dst]))
