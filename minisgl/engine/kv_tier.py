"""The engine's side of the KV host tier: host pages (pinned on CUDA), an optional page file,
and the copies a step plan carries between them and the pool (`Batch.page_copies`; the
bookkeeping is `minisgl.kvcache.tier`'s).

On CUDA the device copies run on a side stream, and the step's stream waits on their event
before its kernels: with overlap scheduling the copies for step N+1 run while the device still
computes step N. Disk reads and writes are host work; before one touches a host page the side
stream is drained (a copy queued earlier may still read or write that page). On the CPU every
copy is a plain one, in order.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from minisgl.core import PageCopy
from minisgl.kvcache import KVPool
from minisgl.kvcache.tier import DEVICE, DISK, HOST

GIB = 1 << 30


@dataclass
class CopyStats:
    """Bytes moved since start, and seconds: loads' copy time (the copy stream busy with
    them) and the time steps waited for copies (the compute stream stalled)."""

    saved_bytes: int = 0
    loaded_bytes: int = 0
    spilled_bytes: int = 0
    fetched_bytes: int = 0
    load_copy_s: float = 0.0
    wait_s: float = 0.0


def _runs(slots: list[int]) -> Iterator[tuple[int, int, int]]:
    """(i, j, first slot) of each stretch of consecutive slots: one copy each."""
    i = 0
    while i < len(slots):
        j = i + 1
        while j < len(slots) and slots[j] == slots[j - 1] + 1:
            j += 1
        yield i, j, slots[i]
        i = j


class TierCopier:
    """Host pages `[host_pages, page_bytes]` uint8 and a page file; runs `PageCopy`s."""

    def __init__(
        self, pool: KVPool, host_pages: int, disk_path: str | None, disk_pages: int
    ) -> None:
        self.pool = pool
        self.on_cuda = pool.device.type == "cuda"
        pb = pool.page_bytes
        self.host = torch.empty(host_pages, pb, dtype=torch.uint8, pin_memory=self.on_cuda)
        self.disk_pages = disk_pages if disk_path else 0
        self._fd: int | None = None
        if disk_path is not None and disk_pages:
            self._fd = os.open(disk_path, os.O_RDWR | os.O_CREAT, 0o600)
            os.ftruncate(self._fd, disk_pages * pb)
        self.stream = torch.cuda.Stream(pool.device) if self.on_cuda else None
        self.stats = CopyStats()
        self._timings: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @property
    def host_pages(self) -> int:
        return self.host.shape[0]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def run(self, copies: list[PageCopy], after_compute: bool = False) -> None:
        """Run `copies` in order; the current stream's later work waits for them.
        `after_compute` (the KV debug mode): they also wait for the work queued before them."""
        if not copies:
            return
        if self.stream is None:
            start = time.perf_counter()
            for c in copies:
                self._copy(c)
            self.stats.wait_s += time.perf_counter() - start
            return
        self.collect()  # (keeps the list of timing events short)
        compute = torch.cuda.current_stream(self.pool.device)
        if after_compute:
            self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            for c in copies:
                self._copy(c)
        self._wait(compute)

    def collect(self, block: bool = False) -> CopyStats:
        """The stats, with the timings of copies that completed (`block`: of all of them)."""
        if self.stream is not None and block:
            self.stream.synchronize()
        pending = []
        for kind, a, b in self._timings:
            if not b.query():
                pending.append((kind, a, b))
                continue
            s = a.elapsed_time(b) / 1e3
            if kind == "load":
                self.stats.load_copy_s += s
            else:
                self.stats.wait_s += s
        self._timings = pending
        return self.stats

    def _wait(self, compute: torch.cuda.Stream) -> None:
        """The compute stream waits for the copies queued so far (timed on it: the stall)."""
        assert self.stream is not None
        a, b = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        done = torch.cuda.Event()
        done.record(self.stream)
        a.record(compute)
        compute.wait_event(done)
        b.record(compute)
        self._timings.append(("wait", a, b))

    def _copy(self, c: PageCopy) -> None:
        pb = self.pool.page_bytes
        if c.kind == (DEVICE, HOST):
            self._save(c.src, c.dst)
            self.stats.saved_bytes += len(c.src) * pb
        elif c.kind == (HOST, DEVICE):
            self._timed("load", lambda: self._load(c.src, c.dst))
            self.stats.loaded_bytes += len(c.src) * pb
        elif c.kind == (HOST, DISK):
            self._disk(c.src, c.dst, write=True)
            self.stats.spilled_bytes += len(c.src) * pb
        else:
            assert c.kind == (DISK, HOST), c.kind
            self._disk(c.dst, c.src, write=False)
            self.stats.fetched_bytes += len(c.src) * pb

    def _timed(self, kind: str, fn: Callable[[], None]) -> None:
        if self.stream is None:
            start = time.perf_counter()
            fn()
            self.stats.load_copy_s += time.perf_counter() - start
            return
        a, b = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        a.record(self.stream)
        fn()
        b.record(self.stream)
        self._timings.append((kind, a, b))

    def _index(self, pages: list[int]) -> torch.Tensor:
        idx = torch.tensor(pages, dtype=torch.int64, pin_memory=self.on_cuda)
        return idx.to(self.pool.device, non_blocking=True)

    def _save(self, pages: list[int], slots: list[int]) -> None:
        data = self.pool.read_pages(self._index(pages))  # [n, page_bytes]
        for i, j, s in _runs(slots):
            self.host[s : s + j - i].copy_(data[i:j], non_blocking=True)

    def _load(self, slots: list[int], pages: list[int]) -> None:
        if self.stream is None:
            self.pool.write_pages(self._index(pages), self.host[slots])
            return
        data = torch.empty(
            len(slots), self.pool.page_bytes, dtype=torch.uint8, device=self.pool.device
        )
        for i, j, s in _runs(slots):
            data[i:j].copy_(self.host[s : s + j - i], non_blocking=True)
        self.pool.write_pages(self._index(pages), data)

    def _disk(self, slots: list[int], disk: list[int], write: bool) -> None:
        """Host `slots[i]` to (or from) disk slot `disk[i]`."""
        assert self._fd is not None
        if self.stream is not None:
            self.stream.synchronize()  # host pages that queued copies still read or write
        pb = self.pool.page_bytes
        for slot, d in zip(slots, disk, strict=True):
            buf = memoryview(self.host[slot].numpy())  # type: ignore[arg-type]
            if write:
                os.pwrite(self._fd, buf, d * pb)
            else:
                os.preadv(self._fd, [buf], d * pb)


def make_tier_copier(
    pool: KVPool, host_gib: float, disk_dir: str | None, disk_gib: float, rank: int
) -> TierCopier | None:
    """The copier for `--kv-host-gib` (None when off); each rank's file of its own."""
    if not host_gib:
        return None
    pb = pool.page_bytes
    host_pages = max(1, int(host_gib * GIB) // pb)
    path, disk_pages = None, 0
    if disk_dir is not None:
        os.makedirs(disk_dir, exist_ok=True)
        path = os.path.join(disk_dir, f"kv-rank{rank}.pages")
        disk_pages = max(1, int(disk_gib * GIB) // pb)
    return TierCopier(pool, host_pages, path, disk_pages)
