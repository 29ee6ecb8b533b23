from __future__ import annotations

import torch


class ReqTable:
    """Device-side rows for running requests: their page ids and their token ids.

    `page_table[slot, i]` is the i-th KV page of the request in `slot`; `token_table[slot, pos]`
    is its token at position `pos`. Steps read their input ids from `token_table` and write
    sampled ids back into it, so step N+1 can be launched before step N's ids reach the host.
    """

    def __init__(
        self, max_reqs: int, max_context: int, page_size: int, device: torch.device
    ) -> None:
        self.max_reqs = max_reqs
        self.max_context = max_context
        self.page_size = page_size
        self.max_pages_per_req = -(-max_context // page_size)
        self.device = device
        self.page_table = torch.zeros(
            max_reqs, self.max_pages_per_req, dtype=torch.int32, device=device
        )
        # One spare column: a step may sample the token after the last context position.
        self.token_table = torch.zeros(max_reqs, max_context + 1, dtype=torch.int32, device=device)
        self._free_slots = list(range(max_reqs - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def alloc_slot(self) -> int:
        return self._free_slots.pop()

    def free_slot(self, slot: int) -> None:
        assert slot not in self._free_slots, f"double free of slot {slot}"
        self._free_slots.append(slot)

    def write_pages(self, slot: int, start: int, pages: list[int]) -> None:
        """Set page ids `start .. start+len(pages)` of `slot` (host→device copy)."""
        if pages:
            src = self._host(pages)
            self.page_table[slot, start : start + len(pages)].copy_(src, non_blocking=True)

    def write_tokens(self, slot: int, start: int, ids: list[int]) -> None:
        if ids:
            src = self._host(ids)
            self.token_table[slot, start : start + len(ids)].copy_(src, non_blocking=True)

    def _host(self, values: list[int]) -> torch.Tensor:
        # Pinned on CUDA: a copy from pageable memory may wait for the stream to drain, which
        # would stall the host while an overlapped step runs.
        return torch.tensor(values, dtype=torch.int32, pin_memory=self.device.type == "cuda")
