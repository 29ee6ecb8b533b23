from __future__ import annotations

from collections.abc import Iterable


class OutOfPagesError(RuntimeError):
    """The allocator was asked for more pages than are free (a scheduler bug: it must check)."""


class PageAllocator:
    """Hands out KV page ids. Pure host-side bookkeeping; O(1) per page."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        # Low ids first keeps small runs compact, which helps debugging more than speed.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, {len(self._free)} free")
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        for p in out:
            self._is_free[p] = 0
        out.reverse()
        return out

    def free(self, pages: Iterable[int]) -> None:
        for p in pages:
            assert not self._is_free[p], f"double free of page {p}"
            self._is_free[p] = 1
            self._free.append(p)


class SlotAllocator:
    """Hands out request-table rows (slots). Pure host-side bookkeeping, like `PageAllocator`."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise OutOfPagesError("no free request slot (a scheduler bug: it must check)")
        slot = self._free.pop()
        self._is_free[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        assert not self._is_free[slot], f"double free of slot {slot}"
        self._is_free[slot] = 1
        self._free.append(slot)
