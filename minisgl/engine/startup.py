"""What start-up built, in one block: the model, where it runs, its weights' memory, the KV
pool, the CUDA graphs and how long it all took (the server logs it once; `LLM` prints it)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

GIB = 1 << 30


@dataclass(frozen=True)
class StartupSummary:
    model: str
    dtype: str
    devices: str  # "cpu", "cuda:0", or "cuda:0 (tp 2: cuda:0..1)"
    weights_bytes: int  # this rank's parameters and buffers
    kv_pages: int  # pages the scheduler hands out
    page_size: int
    kv_dtype: str
    kv_bytes: int  # those pages' K and V, this rank
    graphs: int  # CUDA graphs captured (decode batch sizes + prefill token buckets)
    graphs_s: float
    load_s: float  # weights, KV pool and graphs
    ready_s: float | None = None  # from start to serving (after the warm-up); None: not yet

    @property
    def kv_tokens(self) -> int:
        return self.kv_pages * self.page_size

    def text(self) -> str:
        ready = "" if self.ready_s is None else f"\n  ready in    {self.ready_s:.1f} s"
        graphs = f"{self.graphs} captured in {self.graphs_s:.1f} s" if self.graphs else "none"
        return (
            f"minisgl: {self.model}\n"
            f"  dtype       {self.dtype} on {self.devices}\n"
            f"  weights     {self.weights_bytes / GIB:.2f} GiB (loaded in {self.load_s:.1f} s)\n"
            f"  KV pool     {self.kv_pages} pages x {self.page_size} tokens = {self.kv_tokens} "
            f"tokens, {self.kv_bytes / GIB:.2f} GiB ({self.kv_dtype})\n"
            f"  CUDA graphs {graphs}"
            f"{ready}"
        )


def tensor_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def summarize(engine: Any, model_name: str, started: float | None = None) -> StartupSummary:
    """`engine`: a built `Engine`; `started`: the `time.perf_counter()` of the start, to say
    how long until ready (None: not ready yet)."""
    cfg, pool = engine.config, engine.pool
    devices = str(engine.device)
    if cfg.tp_size > 1:
        devices += f" (tp {cfg.tp_size})"
    bytes_per_page = pool.bytes_per_page(
        pool.num_layers, pool.page_size, pool.num_kv_heads, pool.head_dim, pool.dtype
    )
    return StartupSummary(
        model=model_name,
        dtype=cfg.dtype,
        devices=devices,
        weights_bytes=tensor_bytes(engine.model),
        kv_pages=engine.num_pages,
        page_size=cfg.page_size,
        kv_dtype=cfg.kv_cache_dtype,
        kv_bytes=bytes_per_page * engine.num_pages,
        graphs=engine.num_graphs,
        graphs_s=engine.graphs_s,
        load_s=engine.load_s,
        ready_s=None if started is None else time.perf_counter() - started,
    )
