"""Attention backends: `torch` (reference, any device) and `triton` (CUDA)."""

from __future__ import annotations

from minisgl.attention.base import AttentionBackend, AttentionInputs, KVStore
from minisgl.kvcache import KVPool, ReqTable

BACKENDS = ("torch", "triton")


def make_backend(
    name: str,
    pool: KVPool,
    table: ReqTable,
    num_q_heads: int,
    sm_scale: float,
    deterministic: bool = False,
) -> AttentionBackend:
    if name == "torch":
        from minisgl.attention.torch_backend import TorchBackend

        return TorchBackend(pool, table, num_q_heads, sm_scale, deterministic)
    if name == "triton":
        from minisgl.attention.triton_backend import TritonBackend

        return TritonBackend(pool, table, num_q_heads, sm_scale, deterministic)
    raise ValueError(f"attention backend: {name!r} is not one of {BACKENDS}")


__all__ = ["BACKENDS", "AttentionBackend", "AttentionInputs", "KVStore", "make_backend"]
