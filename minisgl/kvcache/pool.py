from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn


class KVPool:
    """Per-layer K and V pages.

    Token slot `page * page_size + offset` holds one token's K (and V) for every KV head:
    `k(layer)` is `[num_pages * page_size, num_kv_heads, head_dim]`, pages contiguous.

    An FP8 (e4m3) pool stores K / scale and V / scale with one fp32 scale per (layer, KV head):
    `scales(layer)`. Readers multiply by it again. Per head rather than per layer because the
    kernels read it as one scalar per program (every program owns one KV head), so it is free,
    and heads of one layer differ in range by an order of magnitude or more; it also keeps
    tensor-parallel ranks independent (each calibrates the heads it holds).

    K is stored minus a shift per (layer, KV head, channel), `k_shift(layer)` (zero unless
    calibrated: the keys' mean). Readers do not add it back: a query's scores against all keys
    of a head move by the same q . shift, which softmax ignores. Keys carry a large common part
    in some channels; without it the e4m3 rounding (relative to each value) is smaller where it
    matters (SmolLM2: KL to the 16-bit cache roughly halved).

    An FP8 pool stores each page's V transposed, [num_kv_heads, head_dim, page_size] (a page's
    keys side by side for each channel, the layout the P V product reads without byte shuffles:
    `minisgl.kernels.fp8`), so `v(layer)` is `[num_pages, num_kv_heads, head_dim, page_size]`.
    Kernels read whole pages of it, so every byte of it stays finite: zeros when made, and
    stores saturate at +-448 (e4m3 has no infinity, and 0x7f is NaN).
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
        # [2 (K, V), layers, kv_heads] fp32; ones until `set_scales`. Updated in place only:
        # CUDA graphs keep its address.
        self._scales = torch.ones(2, num_layers, num_kv_heads, dtype=torch.float32, device=device)
        # [layers, kv_heads, head_dim] fp32, subtracted from K before it is stored (FP8 only)
        self._k_shift = torch.zeros(
            num_layers, num_kv_heads, head_dim, dtype=torch.float32, device=device
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
    def quantized(self) -> bool:
        """K and V are stored in FP8 with per-head scales."""
        return self.dtype == FP8_KV_DTYPE

    @property
    def spare_loc(self) -> int:
        """First token slot of the last page, which the engine keeps for itself (never handed
        to a request, never poisoned): CUDA-graph padding rows write their K/V there, and
        padded reads of the torch backend read it."""
        return (self.num_pages - 1) * self.page_size

    def k(self, layer: int) -> torch.Tensor:
        return self._buf[0, layer]

    def v(self, layer: int) -> torch.Tensor:
        """[slots, Hkv, D]; an FP8 pool's [pages, Hkv, D, page_size] (see the class doc)."""
        v = self._buf[1, layer]
        if self.quantized:
            return v.view(self.num_pages, self.num_kv_heads, self.head_dim, self.page_size)
        return v

    def scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k_scale, v_scale) [num_kv_heads] fp32 of an FP8 pool's layer; None when unscaled."""
        if not self.quantized:
            return None
        return self._scales[0, layer], self._scales[1, layer]

    def k_shift(self, layer: int) -> torch.Tensor | None:
        """[num_kv_heads, head_dim] fp32 subtracted from an FP8 pool's keys; None when unscaled."""
        return self._k_shift[layer] if self.quantized else None

    def set_k_shift(self, shift: torch.Tensor) -> None:
        """[num_layers, num_kv_heads, head_dim]; only before K/V are stored."""
        self._k_shift.copy_(shift)

    def set_scales(self, k_scales: torch.Tensor, v_scales: torch.Tensor) -> None:
        """[num_layers, num_kv_heads] each (a [num_layers] or [num_layers, 1] tensor is taken as
        one scale per layer). Only before K/V are stored: values already in the pool were
        divided by the old scales."""
        for i, s in enumerate((k_scales, v_scales)):
            s = s.float().reshape(self.num_layers, -1)
            if s.shape[1] not in (1, self.num_kv_heads):
                raise ValueError(
                    f"KV scales of shape {tuple(s.shape)} fit neither one per layer nor one per "
                    f"KV head ({self.num_kv_heads})"
                )
            if not bool((s > 0).all()) or not bool(torch.isfinite(s).all()):
                raise ValueError("KV scales must be finite and positive")
            self._scales[i].copy_(s.expand(self.num_layers, self.num_kv_heads))

    def all_scales(self) -> torch.Tensor:  # [2, layers, kv_heads] fp32
        return self._scales

    def all_k_shifts(self) -> torch.Tensor:  # [layers, kv_heads, head_dim] fp32
        return self._k_shift

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: K and V of every layer (an FP8 pool's scales are per layer and
        head, not per page, so a page's bytes alone carry its KV to another tier and back)."""
        return self._buf[:, :, : self.page_size].numel() * self._buf.element_size()

    def _raw_pages(self) -> torch.Tensor:  # [2, layers, pages, page_bytes / (2 * layers)] uint8
        return self._buf.view(torch.uint8).view(2, self.num_layers, self.num_pages, -1)

    def read_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """[n] int64 page ids (on the pool's device) -> [n, page_bytes] uint8, each page's bytes
        in one row, whatever the layout (an FP8 pool's transposed V pages included)."""
        rows = self._raw_pages().index_select(2, pages)  # [2, layers, n, X]
        return rows.permute(2, 0, 1, 3).reshape(len(pages), -1)

    def write_pages(self, pages: torch.Tensor, data: torch.Tensor) -> None:
        """The inverse of `read_pages`: [n, page_bytes] uint8 into pages [n]."""
        raw = self._raw_pages()
        raw[:, :, pages] = data.view(len(pages), 2, self.num_layers, -1).permute(1, 2, 0, 3)

    def poison(self, pages: list[int]) -> None:
        """Overwrite `pages` with NaN (the KV debug mode, on pages given back to the allocator):
        attention over a page that should no longer be read then shows in the output. An FP8
        pool's V gets 448 instead (its pages stay finite: see the class doc)."""
        if not pages:
            return
        ps = self.page_size
        idx = torch.tensor(pages, dtype=torch.int64).repeat_interleave(ps) * ps
        idx = (idx + torch.arange(ps).repeat(len(pages))).to(self.device, non_blocking=True)
        if self._buf.element_size() == 1:  # FP8: 0x7F is e4m3's NaN
            # K only: V pages must stay finite (kernels read them whole and weigh the slots past
            # a context 0): 448, loud if a wrong page is weighed (its K is NaN anyway).
            self._buf.view(torch.uint8)[0, :, idx] = 0x7F
            self._buf.view(torch.uint8)[1, :, idx] = 0x7E
        else:
            self._buf[:, :, idx] = float("nan")
