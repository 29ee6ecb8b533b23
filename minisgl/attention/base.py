from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple

import torch

from minisgl.kvcache import KVPool, ReqTable


@dataclass
class AttentionInputs:
    """What one step tells the attention backend (built by the engine, on the device).

    B requests, T = sum(extend_lens) new tokens, request i's new tokens are rows
    `cu_extend[i] : cu_extend[i+1]` of q/k/v, at positions `prefix_lens[i] .. seq_lens[i]-1`.
    """

    req_slots: torch.Tensor  # [B] int64, rows of the request table
    seq_lens: torch.Tensor  # [B] int32, tokens in KV after this step
    prefix_lens: torch.Tensor  # [B] int32, tokens already in KV before this step
    extend_lens: torch.Tensor  # [B] int32, new tokens this step
    cu_extend: torch.Tensor  # [B+1] int32, prefix sums of extend_lens
    out_loc: torch.Tensor  # [T] int64, KV slot of every new token
    is_decode: bool  # every request has exactly one new token
    # Host copies, known when the step is built (no device sync needed to read them).
    seq_lens_host: list[int]
    extend_lens_host: list[int]

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_host)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host)

    @property
    def max_extend_len(self) -> int:
        return max(self.extend_lens_host)

    @classmethod
    def fresh_prefill(cls, num_tokens: int, device: torch.device) -> AttentionInputs:
        """One sequence of `num_tokens` new tokens in request-table row 0, no cached prefix, its
        K/V going to pool slots 0 .. num_tokens - 1 (outside the engine's steps: calibration,
        scoring)."""

        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        n = num_tokens
        return cls(
            req_slots=torch.zeros(1, dtype=torch.int64, device=device),
            seq_lens=i32([n]),
            prefix_lens=i32([0]),
            extend_lens=i32([n]),
            cu_extend=i32([0, n]),
            out_loc=torch.arange(n, device=device),
            is_decode=n == 1,
            seq_lens_host=[n],
            extend_lens_host=[n],
        )


class KVStore(NamedTuple):
    """Where one layer's new K/V rows of a step go: `k_cache[loc] = k; v_cache[loc] = v` (an FP8
    cache: (k - k_shift) / k_scale and v / v_scale per KV head, rounded to e4m3)."""

    k_cache: torch.Tensor  # [slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    loc: torch.Tensor  # [T] int64
    scales: tuple[torch.Tensor, torch.Tensor] | None = None  # FP8: [num_kv_heads] fp32 each
    k_shift: torch.Tensor | None = None  # FP8: [num_kv_heads, head_dim] fp32


class AttentionBackend(ABC):
    """Stores a step's new K/V into the paged pool and attends over each request's context.

    `prepare` runs once per step before the model; `forward` once per layer. A backend never
    changes scheduler state (the request table and the pool are written only at the new tokens'
    KV slots).

    A backend that sets `supports_cuda_graph` promises that `prepare` and `forward` of a decode
    step never sync with the host and read only device tensors and the host-side upper bounds in
    `AttentionInputs`, so the engine may capture a decode step and replay it with new lengths.
    """

    supports_cuda_graph: bool = False
    # `MixedMeta` steps (decode and prompt rows in one padded, graph-capturable launch whose
    # grid depends only on a token bucket): a prefilling step can be one graph.
    supports_mixed_step: bool = False

    def __init__(
        self,
        pool: KVPool,
        table: ReqTable,
        num_q_heads: int,
        sm_scale: float,
        deterministic: bool = False,
    ) -> None:
        """`deterministic`: a token's attention sums in one order whatever else the step holds
        (decodes, prefill chunks, verified drafts of other requests) and however its own request
        is split into steps."""
        self.pool = pool
        self.table = table
        self.num_q_heads = num_q_heads
        self.sm_scale = sm_scale
        self.deterministic = deterministic

    @abstractmethod
    def prepare(self, inputs: AttentionInputs) -> object:
        """Per-step metadata (block tables, split plans), passed back to `forward`."""

    def kv_store(self, layer: int, meta: object) -> KVStore | None:
        """Where this layer's new K/V go, for a backend that lets the layer's rotary kernel store
        them as it rotates (one kernel less per layer); None: `forward` stores them."""
        return None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_q_heads, head_dim]
        k: torch.Tensor | None,  # [T, num_kv_heads, head_dim]; None: already in `kv_store`
        v: torch.Tensor | None,  # [T, num_kv_heads, head_dim]; None with k
        layer: int,
        meta: object,
    ) -> torch.Tensor:  # [T, num_q_heads, head_dim]
        ...
