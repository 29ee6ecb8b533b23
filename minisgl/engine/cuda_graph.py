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
import logging
import time
from typing import Any, Protocol

import torch

from minisgl.attention import AttentionBackend, AttentionInputs
from minisgl.config import EngineConfig, ModelConfig
from minisgl.core import Batch
from minisgl.engine.step import StepInputs, StepRows, host_tensor
from minisgl.kvcache import ReqTable
from minisgl.layers import ForwardContext

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to `max_bs` (and `max_bs` itself)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs] + list(range(16, max_bs + 1, 8))
    if max_bs >= 1 and sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class GraphHost(Protocol):
    """What the graphs capture and read of the engine (the `Engine`, or a draft model: its
    own weights and pool over the engine's request table)."""

    config: EngineConfig
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    dummy_loc: int  # KV slot of the spare page that padding rows write to
    backend: AttentionBackend
    model: torch.nn.Module

    @property
    def max_context(self) -> int: ...

    @property
    def table(self) -> ReqTable: ...

    def token_locations(self, req_slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...


def eager_forward(host: GraphHost, step: StepInputs, num_layers: int | None = None) -> torch.Tensor:
    """The host's model on a step's inputs, launched eagerly -> final hidden states [T, hidden]
    (`num_layers`: the first layers only, then the final norm: a layer-skip draft)."""
    inputs = step.attn
    input_ids = host.table.token_table[step.token_slots, step.positions]  # [T]
    inputs.out_loc = host.token_locations(step.token_slots, step.positions)
    ctx = ForwardContext(host.backend, host.backend.prepare(inputs))
    return host.model(input_ids, step.positions, ctx, num_layers=num_layers)  # type: ignore[no-any-return]


class CudaGraphRunner:
    """Captures decode steps at construction (after the KV pool exists) and replays them.

    With `capture=False` (tests on the CPU) `run` executes the same padded step eagerly.
    """

    def __init__(
        self,
        engine: GraphHost,
        capture: bool = True,
        max_bs: int | None = None,
        num_layers: int | None = None,
        pool: Any = None,
    ) -> None:
        """`num_layers`: the first layers only, then the final norm (a layer-skip draft's
        steps); `pool`: another runner's graph memory pool to share (runners that never run at
        once, and whose outputs are copied into their own static buffers)."""
        cfg = engine.config
        self.engine = engine
        self.num_layers = num_layers
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
        self.pool: Any = pool  # the graphs' shared memory pool, from the first capture
        self.captured = capture
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
        """The captured work: a decode step of the first `bs` rows of the static inputs."""
        e = self.engine
        slots, pos, seq_lens = self.inputs[:bs, 0], self.inputs[:bs, 1], self.inputs[:bs, 2]
        out_loc = torch.where(seq_lens > 0, e.token_locations(slots, pos), e.dummy_loc)
        # Upper bounds: they fix the block-table width and the decode split count. A backend
        # that cannot be captured (the torch one, running the padded step eagerly in CPU tests)
        # gets the exact lengths, which its masks are built from.
        bounds = [e.max_context] * bs
        if not self.captured and not e.backend.supports_cuda_graph:
            bounds = seq_lens.tolist()
        inputs = AttentionInputs(
            req_slots=slots,
            seq_lens=seq_lens.int(),
            prefix_lens=pos.int(),
            extend_lens=self.extend_lens[:bs],
            cu_extend=self.cu_extend[: bs + 1],
            out_loc=out_loc,
            is_decode=True,
            seq_lens_host=bounds,
            extend_lens_host=[1] * bs,
        )
        ctx = ForwardContext(e.backend, e.backend.prepare(inputs))
        ids = e.table.token_table[slots, pos]
        hidden = e.model(ids, pos, ctx, num_layers=self.num_layers)  # [bs, hidden]
        self.hidden[:bs].copy_(hidden)

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
        return self.run_rows(batch.slots, batch.prefix_lens, batch.seq_lens)

    def run_rows(self, slots: list[int], positions: list[int], seq_lens: list[int]) -> StepRows:
        """One token per row (request slot, its position, the context length after it; rows
        may share a request: a verify step's drafts, each attending up to itself) through the
        graph of the padded row count; no host sync."""
        n = len(slots)
        bs = self.padded_size(n)
        host: list[int] = []
        for slot, p, s in zip(slots, positions, seq_lens):
            host += (slot, p, s)
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
