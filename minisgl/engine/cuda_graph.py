"""Decode steps as CUDA graphs: one graph per padded batch size, replayed with new inputs.

A graph covers the model's forward for a decode batch: gathering the input ids from the token
table, the KV slots from the page table, every layer (the attention backend gathers its block
table inside the graph too), and the final norm. Its only inputs are three numbers per row in a
static buffer (request slot, position, context length), copied from the host in one transfer;
its output is the final hidden state of each row, also static. The LM head and sampling run
eagerly after it: one per-size logits buffer ([bs, vocab] fp32) would cost more memory than all
the graphs, and the sampler's work depends on host-side flags.

A batch of n requests replays the graph of the smallest captured size >= n. Padding rows have
context length 0: the attention kernels skip them, and their K/V goes to the engine's spare KV
page, so they never touch a request's cache.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from minisgl.attention import AttentionBackend, AttentionInputs
from minisgl.attention.base import KVStore
from minisgl.core import Batch
from minisgl.engine.engine import StepRows
from minisgl.engine.sampler import host_tensor
from minisgl.layers import ForwardContext

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine

logger = logging.getLogger(__name__)

# `MINISGL_TWO_STREAM_DECODE_MIN_BS=N`: decode graphs of N rows or more run as two half-batches
# on two streams (see `CudaGraphRunner._forward`). An experiment, not measured yet: 0 (off)
# unless set. `MINISGL_TWO_STREAM_MODE` says how the halves' attention kernels take turns:
# "priority" (default: on a stream of their own, below the halves' high-priority streams),
# "chain" (on the halves' streams, each waiting on an event of the one before) or "free" (no
# turns: the halves run side by side, in step with each other).
ENV_TWO_STREAM_MIN_BS = "MINISGL_TWO_STREAM_DECODE_MIN_BS"
TWO_STREAM_MIN_BS = int(os.environ.get(ENV_TWO_STREAM_MIN_BS, "0") or 0)
TWO_STREAM_MODES = ("priority", "chain", "free")
TWO_STREAM_MODE = os.environ.get("MINISGL_TWO_STREAM_MODE", "priority")
if TWO_STREAM_MODE not in TWO_STREAM_MODES:
    raise ValueError(
        f"MINISGL_TWO_STREAM_MODE: {TWO_STREAM_MODE!r} is not one of {TWO_STREAM_MODES}"
    )


def _drain(steps: Iterator[object]) -> None:
    for _ in steps:
        pass


class TurnTakingAttention(AttentionBackend):
    """A backend whose attention calls, from several micro-batches on their own streams, run one
    at a time in the order the host issues them: on `stream` (the attention stream: its order is
    the turn order), or, without one, each waiting on an event of the call before.

    With two half-batches issued layer by layer this is a ping-pong: while one half's attention
    reads the KV cache at the copy bandwidth, the other half's latency-bound projections, norms
    and rotation run beside it, and no two attention kernels compete for the bandwidth. On a
    low-priority attention stream, the block scheduler also hands free SM slots to the halves'
    kernels first (torch instantiates graphs with node priorities)."""

    def __init__(self, inner: AttentionBackend, stream: torch.cuda.Stream | None) -> None:
        super().__init__(inner.pool, inner.table, inner.num_q_heads, inner.sm_scale)
        self.inner = inner
        self.stream = stream
        self.last: torch.cuda.Event | None = None  # the previous call's end (no stream)
        self.supports_cuda_graph = inner.supports_cuda_graph

    def prepare(self, inputs: AttentionInputs) -> object:
        return self.inner.prepare(inputs)

    def kv_store(self, layer: int, meta: object) -> KVStore | None:
        return self.inner.kv_store(layer, meta)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: int,
        meta: object,
    ) -> torch.Tensor:
        cur = torch.cuda.current_stream()
        if self.stream is None:
            if self.last is not None:
                cur.wait_event(self.last)
            out = self.inner.forward(q, k, v, layer, meta)
            self.last = torch.cuda.Event()
            self.last.record(cur)
            return out
        self.stream.wait_stream(cur)  # q, and k / v or their store, are written
        for t in (q, k, v):  # read on the attention stream: not reused before it is done
            if t is not None:
                t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            out = self.inner.forward(q, k, v, layer, meta)
        out.record_stream(cur)
        cur.wait_stream(self.stream)
        return out


def graph_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to `max_bs` (and `max_bs` itself)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs] + list(range(16, max_bs + 1, 8))
    if max_bs >= 1 and sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class CudaGraphRunner:
    """Captures decode steps at construction (after the KV pool exists) and replays them.

    With `capture=False` (tests on the CPU) `run` executes the same padded step eagerly.
    """

    def __init__(self, engine: Engine, capture: bool = True, max_bs: int | None = None) -> None:
        cfg = engine.config
        self.engine = engine
        limit = cfg.cuda_graph_max_bs if max_bs is None else max_bs
        self.sizes = graph_batch_sizes(min(limit, cfg.max_running_requests))
        self.max_bs = self.sizes[-1]
        dev = engine.device
        # Per row: request slot, position of the new token, context length after the step.
        self.inputs = torch.zeros(self.max_bs, 3, dtype=torch.int64, device=dev)
        hidden = engine.model_config.hidden_size
        self.hidden = torch.zeros(self.max_bs, hidden, dtype=engine.dtype, device=dev)
        self.extend_lens = torch.ones(self.max_bs, dtype=torch.int32, device=dev)
        self.cu_extend = torch.arange(self.max_bs + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Two-stream decode: the halves' streams and the attention stream, made at first use.
        self.streams: list[torch.cuda.Stream] = []
        self.pool: Any = None  # the graphs' shared memory pool, from the first capture
        self.memory_bytes = self._capture_all() if capture else 0

    # ---- capture -----------------------------------------------------------------------------

    @torch.inference_mode()
    def _capture_all(self) -> int:
        start = time.perf_counter()
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info(self.engine.device)[0]
        for bs in reversed(self.sizes):  # largest first: the smaller ones reuse its pool
            self._capture(bs)
        torch.cuda.synchronize()
        used = free_before - torch.cuda.mem_get_info(self.engine.device)[0]
        logger.info(
            "CUDA graphs: %d batch sizes (1..%d) captured in %.1f s, %.0f MiB",
            len(self.sizes),
            self.max_bs,
            time.perf_counter() - start,
            used / (1 << 20),
        )
        return used

    def _capture(self, bs: int) -> None:
        # Warm up off the capture stream: compiles the Triton kernels and settles allocations.
        stream = torch.cuda.Stream(self.engine.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(bs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self._forward(bs)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[bs] = graph

    def _forward(self, bs: int) -> None:
        """The captured work: a decode step of the first `bs` rows of the static inputs.

        From `TWO_STREAM_MIN_BS` rows on (an experiment, off by default) the batch runs as two
        half-batches on two streams, issued layer by layer in turn, their attention kernels
        taking turns (`TurnTakingAttention`, as `TWO_STREAM_MODE` says): one half's
        latency-bound projections run under the other half's bandwidth-bound attention. Off
        CUDA the halves run the same way on one stream (what the CPU tests check)."""
        if not TWO_STREAM_MIN_BS or bs < TWO_STREAM_MIN_BS:
            _drain(self._rows_steps(0, bs))
            return
        half = bs // 2
        if self.engine.device.type != "cuda":
            _drain(itertools.zip_longest(self._rows_steps(0, half), self._rows_steps(half, bs)))
            return
        if not self.streams:
            dev = self.engine.device  # torch's priorities: -1 high, 0 low (the default)
            self.streams = [torch.cuda.Stream(dev, priority=-1) for _ in range(2)]
            self.streams.append(torch.cuda.Stream(dev, priority=0))  # attention
        mode = TWO_STREAM_MODE
        turns = None
        if mode != "free":
            turns = TurnTakingAttention(
                self.engine.backend, self.streams[2] if mode == "priority" else None
            )
        main = torch.cuda.current_stream()
        for st in self.streams:
            st.wait_stream(main)
        parts = [self._rows_steps(0, half, turns), self._rows_steps(half, bs, turns)]
        _drain(itertools.zip_longest(*(self._on(st, p) for st, p in zip(self.streams, parts))))
        for st in self.streams:
            main.wait_stream(st)

    @staticmethod
    def _on(stream: torch.cuda.Stream, steps: Iterator[object]) -> Iterator[object]:
        """`steps`, each run with `stream` current."""
        while True:
            with torch.cuda.stream(stream):
                step = next(steps, StopIteration)
            if step is StopIteration:
                return
            yield step

    def _rows_steps(
        self, start: int, end: int, backend: AttentionBackend | None = None
    ) -> Iterator[object]:
        """The forward of static-input rows [start, end) one layer per step (the last step
        writes the same rows of `hidden`), through `backend` (default: the engine's)."""
        e, n = self.engine, end - start
        rows = self.inputs[start:end]
        slots, pos, seq_lens = rows[:, 0], rows[:, 1], rows[:, 2]
        out_loc = torch.where(seq_lens > 0, e.token_locations(slots, pos), e.dummy_loc)
        inputs = AttentionInputs(
            req_slots=slots,
            seq_lens=seq_lens.int(),
            prefix_lens=pos.int(),
            extend_lens=self.extend_lens[:n],
            cu_extend=self.cu_extend[: n + 1],
            out_loc=out_loc,
            is_decode=True,
            # Upper bounds: they fix the block-table width and the decode split count.
            seq_lens_host=[e.max_context] * n,
            extend_lens_host=[1] * n,
            row_offset=start,
        )
        backend = backend or e.backend
        ctx = ForwardContext(backend, backend.prepare(inputs))
        ids = e.table.token_table[slots, pos]
        for out in e.model.layer_steps(ids, pos, ctx):  # type: ignore[operator]
            if out is not None:  # the last step: the final hidden states [n, hidden]
                self.hidden[start:end].copy_(out)
            yield out

    # ---- replay ------------------------------------------------------------------------------

    def can_run(self, batch: Batch) -> bool:
        """A decode batch (one new token per request, every row sampling) that fits a graph."""
        return (
            batch.num_tokens == batch.size <= self.max_bs and batch.size > 0 and all(batch.sample)
        )

    def padded_size(self, n: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def run(self, batch: Batch) -> StepRows:
        """Replay the graph of the batch's padded size; no host sync."""
        n = batch.size
        bs = self.padded_size(n)
        host: list[int] = []
        for r, p, s in zip(batch.reqs, batch.prefix_lens, batch.seq_lens):
            assert r.slot is not None
            host += (r.slot, p, s)
        host += [0] * (3 * (bs - n))  # padding rows: context length 0
        on_cuda = self.engine.device.type == "cuda"
        src = host_tensor(host, torch.int64, pin=on_cuda).view(bs, 3)
        self.inputs[:bs].copy_(src, non_blocking=True)
        graph = self.graphs.get(bs)
        if graph is not None:
            graph.replay()
        else:
            self._forward(bs)
        return StepRows(self.hidden[:n], self.inputs[:n, 0], self.inputs[:n, 2])
