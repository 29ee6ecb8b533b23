from __future__ import annotations

from collections.abc import Iterable


class OutOfPagesError(RuntimeError):
    """The allocator was asked for more pages than are free (a scheduler bug: it must check)."""


class PageAllocator:
    """Hands out KV page ids (`SlotAllocator`: request-table rows). Pure host-side bookkeeping;
    O(1) per id; a double free fails an assertion."""

    what = "page"

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
            raise OutOfPagesError(f"asked for {n} {self.what}s, {len(self._free)} free")
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
            assert not self._is_free[p], f"double free of {self.what} {p}"
            self._is_free[p] = 1
            self._free.append(p)


class SlotAllocator(PageAllocator):
    """Hands out request-table rows (slots)."""

    what = "slot"

    @property
    def num_slots(self) -> int:
        return self.num_pages
