"""Prefilling steps as piecewise CUDA graphs: the dense parts of the forward captured per
token-count bucket, attention launched eagerly between them.

An eager step of a 28-layer model launches ~600 kernels from Python: on the H200 that took
15-16 ms of host time for a step whose kernels take 2-3 ms, and 20-30 ms when the token count
was new to cuBLAS (so every arriving prompt stalled the streams beside it by that much).
The attention of a prefilling step depends on host-side numbers (which requests prefill, their
lengths), so the step cannot be one graph; everything else depends only on the token count.
So a step of T tokens runs at the smallest bucket Tp >= T: a graph from each layer's attention
output to the next layer's q/k/v projections (o_proj, the MLP, the norms; the first graph also
embeds, the last ends with the final norm), and between two graphs the layer's `attend` (RoPE,
KV store, attention) runs eagerly on the step's T real rows, writing into one static buffer
that the next graph reads. Padding rows (T..Tp) read token 0 and stale attention outputs; every
op outside attention treats rows independently, so they never reach a real row, and their
results are dropped.

Dense models at tp = 1 on CUDA (a mixture of experts routes on host-side numbers; the
all-reduce buffers are sized for decode batches). With `capture=False` (tests on the CPU) `run`
executes the same padded, split step eagerly.

With `whole_step` (off by default; the Triton backend only) a bucket is ONE graph of the whole
forward: every layer's attention is `mixed_attention`, whose launch depends only on the bucket
and the request capacity, reading static buffers (`MixedMeta`) that `run` refills before the
replay; padding rows store their K/V at the spare slot.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from minisgl.core import Batch
from minisgl.engine.step import StepRows, batch_inputs
from minisgl.layers import ForwardContext

if TYPE_CHECKING:
    from minisgl.attention.triton_backend import MixedMeta

logger = logging.getLogger(__name__)

# A layer's attention: [T, q + k + v] projections, [T] positions -> [T, Hq * D].
AttendFn = Callable[[torch.Tensor, torch.Tensor, ForwardContext], torch.Tensor]


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts captured: by 32 to 512, by 64 to 1024, by 128 to 2048, then by 512, and
    `max_tokens` (up to 2048 tokens, padding adds at most an eighth of a step's dense work)."""
    steps = [*range(32, 512, 32), *range(512, 1024, 64), *range(1024, 2048, 128)]
    steps += range(2048, max_tokens, 512)
    return [s for s in steps if s < max_tokens] + [max_tokens]


class Recorder:
    """`ForwardContext.pieces` while a bucket is captured: each attention layer's `split` ends
    the graph being captured, notes the layer, and starts the next graph."""

    def __init__(self, out: torch.Tensor, pool: Any) -> None:
        self.out = out  # [max_tokens, Hq * D]: every layer's attention output, every bucket
        self.pool = pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.splits: list[tuple[torch.Tensor, AttendFn]] = []

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        self.graphs.append(graph)

    def end(self) -> None:
        self.graphs[-1].capture_end()
        if self.pool is None:
            self.pool = self.graphs[-1].pool()

    def split(self, qkv: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        self.end()
        self.splits.append((qkv, attend))
        self.begin()
        return self.out[: qkv.shape[0]]


class Live:
    """`ForwardContext.pieces` of an uncaptured run (and of the warm-up before a capture):
    the layer's attention runs at once on the first `t` rows, into the static buffer."""

    def __init__(self, out: torch.Tensor, t: int, positions: torch.Tensor, ctx: Any) -> None:
        self.out, self.t, self.positions, self.ctx = out, t, positions, ctx

    def split(self, qkv: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        if self.ctx is not None:  # None: a warm-up, whose values do not matter
            self.out[: self.t].copy_(attend(qkv[: self.t], self.positions, self.ctx))
        return self.out[: qkv.shape[0]]


@dataclass
class Pieces:
    """One bucket: its graphs (one more than splits), the splits, and the final hidden states
    [Tp, hidden] that the last graph writes."""

    graphs: list[torch.cuda.CUDAGraph]
    splits: list[tuple[torch.Tensor, AttendFn]]
    hidden: torch.Tensor


class PiecewiseGraphRunner:
    """Captures every bucket of `token_buckets(max_tokens)` at construction (with `capture`)
    and runs prefilling steps of up to `max_tokens` tokens through them. `engine` is the
    `Engine`: its device, dtype, configs, model, backend, token table, `token_locations` and
    `sampled_rows`."""

    def __init__(
        self, engine: Any, max_tokens: int, capture: bool = True, whole_step: bool = False
    ) -> None:
        self.engine = engine
        self.sizes = token_buckets(max_tokens)
        self.max_tokens = self.sizes[-1]
        dev, mcfg = engine.device, engine.model_config
        self.ids = torch.zeros(self.max_tokens, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(self.max_tokens, dtype=torch.int64, device=dev)
        q_size = mcfg.num_heads * mcfg.head_dim // engine.config.tp_size
        # Zeros: padding rows read finite numbers before any step has written the buffer.
        self.attn_out = torch.zeros(self.max_tokens, q_size, dtype=engine.dtype, device=dev)
        self.pool: Any = None
        self.pieces: dict[int, Pieces] = {}
        self.mixed: WholeStep | None = WholeStep(engine, self.max_tokens) if whole_step else None
        self.whole: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            start = time.perf_counter()
            for tp in reversed(self.sizes):  # largest first: the smaller ones reuse its pool
                if self.mixed is None:
                    self.pieces[tp] = self._capture(tp)
                else:
                    self.whole[tp] = self._capture_whole(tp)
            logger.info(
                "piecewise CUDA graphs: %d token counts (%d..%d) captured in %.1f s",
                len(self.sizes),
                self.sizes[0],
                self.max_tokens,
                time.perf_counter() - start,
            )

    @torch.inference_mode()
    def _capture(self, tp: int) -> Pieces:
        stream = torch.cuda.Stream(self.engine.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiles the Triton kernels and settles allocations
                self._forward(tp, Live(self.attn_out, tp, self.positions[:tp], None))
            recorder = Recorder(self.attn_out, self.pool)
            recorder.begin()
            hidden = self._forward(tp, recorder)
            recorder.end()
        torch.cuda.current_stream().wait_stream(stream)
        self.pool = recorder.pool
        return Pieces(recorder.graphs, recorder.splits, hidden)

    @torch.inference_mode()
    def _capture_whole(self, tp: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        stream = torch.cuda.Stream(self.engine.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiles the kernels, allocates the split counters
                self._forward_whole(tp)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(
                graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"
            ):
                hidden = self._forward_whole(tp)
        torch.cuda.current_stream().wait_stream(stream)
        self.pool = graph.pool()
        return graph, hidden

    def _forward_whole(self, tp: int) -> torch.Tensor:
        assert self.mixed is not None
        e = self.engine
        ctx = ForwardContext(e.backend, self.mixed.meta(tp))
        return e.model(self.ids[:tp], self.positions[:tp], ctx)  # type: ignore[no-any-return]

    def _forward(self, tp: int, pieces: Recorder | Live) -> torch.Tensor:
        e = self.engine
        ctx = ForwardContext(e.backend, None, pieces=pieces)
        return e.model(self.ids[:tp], self.positions[:tp], ctx)  # type: ignore[no-any-return]

    def can_run(self, batch: Batch) -> bool:
        """A step that prefills (the decode graphs take the others) of at most `max_tokens`."""
        return batch.num_tokens != batch.size and batch.num_tokens <= self.max_tokens

    def _run_whole(self, batch: Batch) -> StepRows | None:
        """The bucket's one graph (or, uncaptured, the same padded forward eagerly)."""
        assert self.mixed is not None
        e = self.engine
        step = batch_inputs(batch, e.device)
        t = batch.num_tokens
        tp = self.sizes[bisect.bisect_left(self.sizes, t)]
        self.ids[:t].copy_(e.table.token_table[step.token_slots, step.positions])
        self.positions[:t].copy_(step.positions)
        self.mixed.fill(step.attn, e.token_locations(step.token_slots, step.positions), t)
        captured = self.whole.get(tp)
        if captured is None:
            hidden = self._forward_whole(tp)
        else:
            captured[0].replay()
            hidden = captured[1]
        return e.sampled_rows(batch, step, hidden[:t])  # type: ignore[no-any-return]

    def run(self, batch: Batch) -> StepRows | None:
        """The bucket's graphs with the layers' attention between them; no host sync."""
        if self.mixed is not None:
            return self._run_whole(batch)
        e = self.engine
        step = batch_inputs(batch, e.device)
        t = batch.num_tokens
        tp = self.sizes[bisect.bisect_left(self.sizes, t)]
        self.ids[:t].copy_(e.table.token_table[step.token_slots, step.positions])
        step.attn.out_loc = e.token_locations(step.token_slots, step.positions)
        ctx = ForwardContext(e.backend, e.backend.prepare(step.attn))
        ctx = e.model.attention_context(ctx, step.positions, self.attn_out)
        pieces = self.pieces.get(tp)
        if pieces is None:  # not captured: the same padded, split step, eagerly
            hidden = self._forward(tp, Live(self.attn_out, t, step.positions, ctx))
        else:
            for graph, (qkv, attend) in zip(pieces.graphs, pieces.splits):
                graph.replay()
                self.attn_out[:t].copy_(attend(qkv[:t], step.positions, ctx))
            pieces.graphs[-1].replay()
            hidden = pieces.hidden
        return e.sampled_rows(batch, step, hidden[:t])  # type: ignore[no-any-return]


class WholeStep:
    """The static attention inputs of whole-step graphs (`MixedMeta`), sized by the largest
    bucket and the request table's capacity, shared by every bucket."""

    def __init__(self, engine: Any, max_tokens: int) -> None:
        from minisgl.attention.triton_backend import TritonBackend  # imports Triton

        if not isinstance(engine.backend, TritonBackend):
            raise ValueError("whole-step piecewise graphs need attention_backend='triton'")
        dev, table = engine.device, engine.table
        max_reqs, width = table.page_table.shape
        self.dummy_loc = int(engine.dummy_loc)
        self.out_loc = torch.full((max_tokens,), self.dummy_loc, dtype=torch.int64, device=dev)
        self.block_table = torch.zeros(max_reqs, width, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(max_reqs, dtype=torch.int32, device=dev)
        self.cu_extend = torch.zeros(max_reqs + 1, dtype=torch.int32, device=dev)
        self.page_table = table.page_table
        # Splits of the one-token rows' keys: one split per request is what a W4-like mixed
        # step wants (tens of decodes x 8 KV heads fill the GPU); the benchmark's --mixed
        # table says whether a fixed 2 or 4 pays at a few decodes with long contexts.
        self.num_splits = 1

    def meta(self, tp: int) -> MixedMeta:
        from minisgl.attention.triton_backend import MixedMeta

        return MixedMeta(
            self.out_loc[:tp], self.block_table, self.seq_lens, self.cu_extend, self.num_splits
        )

    def fill(self, attn: Any, out_loc: torch.Tensor, t: int) -> None:
        """Copy one step (AttentionInputs of B requests, [T] KV slots) into the buffers; past
        the step: the spare slot, no rows."""
        b = attn.seq_lens.shape[0]
        self.out_loc[:t].copy_(out_loc)
        self.out_loc[t:].fill_(self.dummy_loc)
        self.block_table[:b].copy_(self.page_table[attn.req_slots])
        self.seq_lens[:b].copy_(attn.seq_lens)
        self.cu_extend[: b + 1].copy_(attn.cu_extend)
        self.cu_extend[b + 1 :].fill_(t)
