from __future__ import annotations

from collections.abc import Iterable

import torch

from minisgl.core import TableWrite


class ReqTable:
    """Device-side rows for running requests: their page ids and their token ids.

    `page_table[slot, i]` is the i-th KV page of the request in `slot`; `token_table[slot, pos]`
    is its token at position `pos`. Steps read their input ids from `token_table` and write
    sampled ids back into it, so step N+1 can be launched before step N's ids reach the host.
    Which slot belongs to whom is the scheduler's bookkeeping (`SlotAllocator`); the table only
    applies the writes a step plan carries.
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

    def apply(self, page_writes: Iterable[TableWrite], token_writes: Iterable[TableWrite]) -> None:
        """Enqueue the writes (host-to-device copies on the current stream, in order)."""
        for w in page_writes:
            self._write(self.page_table, w)
        for w in token_writes:
            self._write(self.token_table, w)

    def _write(self, table: torch.Tensor, w: TableWrite) -> None:
        if w.values:
            # Pinned on CUDA: a copy from pageable memory may wait for the stream to drain,
            # which would stall the host while an overlapped step runs.
            src = torch.tensor(w.values, dtype=torch.int32, pin_memory=self.device.type == "cuda")
            table[w.slot, w.start : w.start + len(w.values)].copy_(src, non_blocking=True)
