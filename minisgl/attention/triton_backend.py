"""Paged attention with the Triton kernels (CUDA; Triton's CPU interpreter in tests).

`prepare` gathers the step's block table once (every layer shares it) and picks the decode split
count from host-side numbers only, so a decode step can be captured in a CUDA graph: the graph
runner hands in upper bounds (`seq_lens_host` = the context limit), which fixes the block-table
width and the split count for every replay, and the kernels read the true lengths on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from minisgl.attention.base import AttentionBackend, AttentionInputs, KVStore
from minisgl.kernels.attention.decode import (
    DecodeConfig,
    choose_num_splits,
    decode_attention,
    default_decode_config,
)
from minisgl.kernels.attention.extend import ExtendConfig, default_extend_config, extend_attention
from minisgl.kernels.attention.mixed import MixedConfig, default_mixed_config, mixed_attention
from minisgl.kernels.attention.store import store_kv
from minisgl.kernels.common import num_sms
from minisgl.kvcache import KVPool, ReqTable


@dataclass
class ExtendPart:
    """The rows of a mixed step after its leading one-token rows, rebased to start at 0."""

    block_table: torch.Tensor  # [Be, P] int32
    seq_lens: torch.Tensor  # [Be] int32
    extend_lens: torch.Tensor  # [Be] int32
    cu_extend: torch.Tensor  # [Be+1] int32, from 0
    max_extend_len: int  # sizes the grid


@dataclass
class TritonMeta:
    inputs: AttentionInputs
    block_table: torch.Tensor  # [Bd, P] int32, the pages of the decode rows
    seq_lens: torch.Tensor  # [Bd] int32, context lengths of the decode rows
    num_decode: int  # leading rows with one new token: the decode kernel takes them
    num_splits: int  # decode: splits per request (fixed for a captured batch size)
    extend: ExtendPart | None  # the remaining rows: the extend kernel takes them


@dataclass
class MixedMeta:
    """A whole prefilling step at a capacity, for `mixed_attention` (one kernel per layer,
    whatever the mix of decode and prefill rows): static buffers that a CUDA graph captured
    once per token bucket reads, refilled before each replay (`PiecewiseGraphRunner` with
    `whole_step`). Padding rows store their K/V at the spare slot and get zeros."""

    out_loc: torch.Tensor  # [Tp] int64, the spare slot past the step's rows
    block_table: torch.Tensor  # [Bmax, P] int32, P = the request table's width
    seq_lens: torch.Tensor  # [Bmax] int32
    cu_extend: torch.Tensor  # [Bmax+1] int32, constant past the step's requests
    num_splits: int  # key splits of the one-token rows (fixed per capture)


class TritonBackend(AttentionBackend):
    supports_cuda_graph = True
    supports_mixed_step = True

    def __init__(
        self,
        pool: KVPool,
        table: ReqTable,
        num_q_heads: int,
        sm_scale: float,
        deterministic: bool = False,
    ) -> None:
        super().__init__(pool, table, num_q_heads, sm_scale, deterministic)
        self.decode_config: DecodeConfig = default_decode_config(pool.head_dim, pool.quantized)
        self.extend_config: ExtendConfig = default_extend_config(
            pool.head_dim, torch.empty((), dtype=pool.dtype).element_size()
        )
        self.mixed_config: MixedConfig = default_mixed_config(
            pool.head_dim, torch.empty((), dtype=pool.dtype).element_size()
        )
        if deterministic:
            self.mixed_config = invariant_mixed_config(self.mixed_config)
        self.num_sms = num_sms(pool.device)

    def prepare(self, inputs: AttentionInputs) -> TritonMeta | MixedMeta:
        """A mixed step's leading one-token rows (the scheduler puts decodes first) go to the
        decode kernel, which reads each KV head once for its whole query group; an extend
        tile would spend a BLOCK_M-row tile and a KV read per query head on each of them.
        Deterministic: every step is one `mixed_attention` of one split and one tile shape
        (`invariant_mixed_config`), decode steps (and their CUDA graphs) included."""
        ps = self.pool.page_size
        width = min(-(-inputs.max_seq_len // ps), self.table.max_pages_per_req)
        block_table = self.table.page_table[inputs.req_slots, :width]  # [B, P] gather
        if self.deterministic:
            return MixedMeta(inputs.out_loc, block_table, inputs.seq_lens, inputs.cu_extend, 1)
        ext = inputs.extend_lens_host
        nd = inputs.batch_size if inputs.is_decode else _leading_ones(ext)
        num_splits, extend = 1, None
        if nd:
            max_dec = inputs.max_seq_len if inputs.is_decode else max(inputs.seq_lens_host[:nd])
            num_splits = choose_num_splits(
                nd, self.pool.num_kv_heads, max_dec, self.num_sms, self.decode_config
            )
        if nd < inputs.batch_size:
            # Copies, not views: Triton compiles a kernel variant per pointer alignment, and a
            # view starting at row nd would add variants (each a JIT compile mid-serving).
            extend = ExtendPart(
                block_table=block_table[nd:].clone() if nd else block_table,
                seq_lens=inputs.seq_lens[nd:].clone() if nd else inputs.seq_lens,
                extend_lens=inputs.extend_lens[nd:].clone() if nd else inputs.extend_lens,
                cu_extend=inputs.cu_extend[nd:] - nd,
                max_extend_len=max(ext[nd:]),
            )
        return TritonMeta(inputs, block_table[:nd], inputs.seq_lens[:nd], nd, num_splits, extend)

    def kv_store(self, layer: int, meta: object) -> KVStore:
        assert isinstance(meta, TritonMeta | MixedMeta)
        pool = self.pool
        loc = meta.inputs.out_loc if isinstance(meta, TritonMeta) else meta.out_loc
        return KVStore(pool.k(layer), pool.v(layer), loc, pool.scales(layer), pool.k_shift(layer))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: int,
        meta: object,
    ) -> torch.Tensor:
        k_cache, v_cache = self.pool.k(layer), self.pool.v(layer)
        scales = self.pool.scales(layer)
        if k is not None:  # else the layer's rotary kernel stored them (`kv_store`)
            assert v is not None
            store = self.kv_store(layer, meta)
            store_kv(k_cache, v_cache, store.loc, k, v, scales, self.pool.k_shift(layer))
        ps = self.pool.page_size
        if isinstance(meta, MixedMeta):
            return mixed_attention(
                q, k_cache, v_cache, meta.block_table, meta.seq_lens, meta.cu_extend, ps,
                self.sm_scale, num_splits=meta.num_splits, config=self.mixed_config,
                kv_scales=scales,
            )  # fmt: skip
        assert isinstance(meta, TritonMeta)
        nd, ext = meta.num_decode, meta.extend
        out = torch.empty_like(q)
        if nd:
            decode_attention(
                q[:nd], k_cache, v_cache, meta.block_table, meta.seq_lens, ps, self.sm_scale,
                num_splits=meta.num_splits, config=self.decode_config, out=out[:nd],
                kv_scales=scales,
            )  # fmt: skip
        if ext is not None:
            extend_attention(
                q[nd:], k_cache, v_cache, ext.block_table, ext.seq_lens, ext.extend_lens,
                ext.cu_extend, ps, self.sm_scale, ext.max_extend_len, config=self.extend_config,
                out=out[nd:], kv_scales=scales,
            )  # fmt: skip
        return out


def invariant_mixed_config(cfg: MixedConfig) -> MixedConfig:
    """`cfg` with one tile for every row: prefill blocks of the 16 (token, head) rows of a
    decode tile, and the decode tile's key block. With one split, a token's keys then fold
    in blocks from position 0 in one order, through one tile shape, whether its request
    decodes, verifies drafts or prefills, and whatever else the step holds (blocks past its
    position weigh 0 and leave its sums unchanged)."""
    return replace(cfg, rows_wide=16, block_n=cfg.block_n_narrow)


def _leading_ones(extend_lens: list[int]) -> int:
    return next((i for i, e in enumerate(extend_lens) if e != 1), len(extend_lens))
