from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from minisgl.attention.base import AttentionBackend


@dataclass
class ForwardContext:
    """What a model forward needs besides token ids and positions: passed explicitly."""

    backend: AttentionBackend
    meta: object  # the backend's per-step metadata from `prepare`
    # RoPE rows of this step's positions (`RotaryEmbedding.lookup`), looked up once for all
    # layers by models that run the torch rotation; None: each layer looks them up.
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    # Piecewise CUDA graphs (`minisgl.engine.piecewise`): each attention layer hands its q/k/v
    # projections and its `attend` to `pieces.split` and reads its output from what that returns.
    pieces: Splitter | None = None


class Splitter(Protocol):
    def split(
        self,
        qkv: torch.Tensor,
        attend: Callable[[torch.Tensor, torch.Tensor, ForwardContext], torch.Tensor],
    ) -> torch.Tensor: ...


class PagedAttention(nn.Module):
    """Attention over the paged KV pool of one layer; the backend stores the new K/V."""

    def __init__(self, layer: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (None: already stored, see `AttentionBackend.kv_store`)
        -> [T, Hq * D]."""
        out = ctx.backend.forward(q, k, v, self.layer, ctx.meta)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
