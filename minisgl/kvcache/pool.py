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

    def k(self, layer: int) -> torch.Tensor:
        return self._buf[0, layer]

    def v(self, layer: int) -> torch.Tensor:
        return self._buf[1, layer]
