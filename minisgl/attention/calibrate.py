"""An attention backend for FP8 KV calibration: it records, per (layer, KV head), the sum of the
keys (their mean becomes the pool's key shift) and the largest |K - shift| and |V|, and attends
in the model dtype without touching the pool, so the values it sees are the ones a 16-bit cache
would hold."""

from __future__ import annotations

import torch

from minisgl.attention.base import AttentionBackend, AttentionInputs
from minisgl.attention.torch_backend import causal_attention
from minisgl.kvcache import KVPool, ReqTable


class CalibrationBackend(AttentionBackend):
    """Prefills of fresh sequences only (no cached prefix, nothing stored)."""

    def __init__(
        self,
        pool: KVPool,
        table: ReqTable,
        num_q_heads: int,
        sm_scale: float,
        k_shift: torch.Tensor | None = None,  # [layers, kv_heads, head_dim]: taken off K first
    ) -> None:
        super().__init__(pool, table, num_q_heads, sm_scale)
        shape = (pool.num_layers, pool.num_kv_heads)
        self.k_shift = k_shift
        self.amax = torch.zeros(2, *shape, device=pool.device)  # [2 (K, V), layers, kv_heads]
        self.k_sum = torch.zeros(*shape, pool.head_dim, dtype=torch.float64, device=pool.device)
        self.tokens = 0  # seen by every layer

    def prepare(self, inputs: AttentionInputs) -> AttentionInputs:
        if inputs.seq_lens_host != inputs.extend_lens_host:
            raise ValueError("calibration runs fresh sequences only (no cached prefix)")
        return inputs

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: int,
        meta: object,
    ) -> torch.Tensor:
        assert isinstance(meta, AttentionInputs) and k is not None and v is not None
        self.k_sum[layer] += k.double().sum(dim=0)  # [Hkv, D]
        self.tokens += k.shape[0] if layer == 0 else 0
        k_off = k.float() if self.k_shift is None else k.float() - self.k_shift[layer]
        for i, x in enumerate((k_off, v)):  # [T, Hkv, D]
            amax = x.abs().amax(dim=(0, 2)).float()
            torch.maximum(self.amax[i, layer], amax, out=self.amax[i, layer])
        out = torch.empty_like(q)
        start = 0
        for n in meta.extend_lens_host:
            rows = slice(start, start + n)
            q_i, k_i, v_i = (x[rows].transpose(0, 1) for x in (q, k, v))  # [H, n, D]
            out[rows] = causal_attention(q_i, k_i, v_i, self.sm_scale).transpose(0, 1)
            start += n
        return out

    @property
    def k_mean(self) -> torch.Tensor:  # [layers, kv_heads, head_dim] fp32
        return (self.k_sum / max(1, self.tokens)).float()
