"""Paged attention with the Triton kernels (CUDA; Triton's CPU interpreter in tests).

`prepare` gathers the step's block table once (every layer shares it) and picks the decode split
count from host-side numbers only, so a decode step can be captured in a CUDA graph: the graph
runner hands in upper bounds (`seq_lens_host` = the context limit), which fixes the block-table
width and the split count for every replay, and the kernels read the true lengths on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.attention.base import AttentionBackend, AttentionInputs
from minisgl.kernels.common import num_sms
from minisgl.kernels.decode import (
    DecodeConfig,
    choose_num_splits,
    decode_attention,
    default_decode_config,
)
from minisgl.kernels.extend import ExtendConfig, default_extend_config, extend_attention
from minisgl.kernels.store import store_kv
from minisgl.kvcache import KVPool, ReqTable


@dataclass
class TritonMeta:
    inputs: AttentionInputs
    block_table: torch.Tensor  # [B, P] int32, the pages of each request of the step
    num_splits: int  # decode: splits per request (fixed for a captured batch size)
    max_extend_len: int  # extend: sizes the grid


class TritonBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, pool: KVPool, table: ReqTable, num_q_heads: int, sm_scale: float) -> None:
        super().__init__(pool, table, num_q_heads, sm_scale)
        self.decode_config: DecodeConfig = default_decode_config(pool.head_dim)
        self.extend_config: ExtendConfig = default_extend_config(
            pool.head_dim, torch.empty((), dtype=pool.dtype).element_size()
        )
        self.num_sms = num_sms(pool.device)

    def prepare(self, inputs: AttentionInputs) -> TritonMeta:
        ps = self.pool.page_size
        width = min(-(-inputs.max_seq_len // ps), self.table.max_pages_per_req)
        block_table = self.table.page_table[inputs.req_slots, :width]  # [B, P] gather
        num_splits = 1
        if inputs.is_decode:
            num_splits = choose_num_splits(
                inputs.batch_size,
                self.pool.num_kv_heads,
                inputs.max_seq_len,
                self.num_sms,
                self.decode_config,
            )
        return TritonMeta(inputs, block_table, num_splits, inputs.max_extend_len)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: object
    ) -> torch.Tensor:
        assert isinstance(meta, TritonMeta)
        k_cache, v_cache = self.pool.k(layer), self.pool.v(layer)
        inp = meta.inputs
        store_kv(k_cache, v_cache, inp.out_loc, k, v)
        ps = self.pool.page_size
        if inp.is_decode:
            return decode_attention(
                q, k_cache, v_cache, meta.block_table, inp.seq_lens, ps, self.sm_scale,
                num_splits=meta.num_splits, config=self.decode_config,
            )  # fmt: skip
        return extend_attention(
            q, k_cache, v_cache, meta.block_table, inp.seq_lens, inp.extend_lens,
            inp.cu_extend, ps, self.sm_scale, meta.max_extend_len, config=self.extend_config,
        )  # fmt: skip
