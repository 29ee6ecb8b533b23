from __future__ import annotations

import torch


class KVPool:
    """Per-layer K and V pages.

    Token slot `page * page_size + offset` holds one token's K (and V) for every KV head:
    `k(layer)` is `[num_pages * page_size, num_kv_heads, head_dim]`, pages contiguous.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        # [2, layers, slots, kv_heads, head_dim]
        self._buf = torch.zeros(
            2, num_layers, num_pages * page_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * elem

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def spare_loc(self) -> int:
        """First token slot of the last page, which the engine keeps for itself (never handed
        to a request, never poisoned): CUDA-graph padding rows write their K/V there, and
        padded reads of the torch backend read it."""
        return (self.num_pages - 1) * self.page_size

    def k(self, layer: int) -> torch.Tensor:
        return self._buf[0, layer]

    def v(self, layer: int) -> torch.Tensor:
        return self._buf[1, layer]

    def poison(self, pages: list[int]) -> None:
        """Overwrite `pages` with NaN (the KV debug mode, on pages given back to the allocator):
        attention over a page that should no longer be read then shows in the output."""
        if not pages:
            return
        ps = self.page_size
        idx = torch.tensor(pages, dtype=torch.int64).repeat_interleave(ps) * ps
        idx = (idx + torch.arange(ps).repeat(len(pages))).to(self.device, non_blocking=True)
        if self._buf.element_size() == 1:  # FP8: 0x7F is e4m3's NaN
            self._buf.view(torch.uint8)[:, :, idx] = 0x7F
        else:
            self._buf[:, :, idx] = float("nan")
