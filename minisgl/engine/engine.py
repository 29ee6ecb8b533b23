from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

import torch

from minisgl.attention import AttentionInputs, make_backend
from minisgl.config import (
    EngineConfig,
    ModelConfig,
    resolve_engine_config,
    resolve_model_quantization,
)
from minisgl.core import Batch, Req
from minisgl.engine.kv_calibration import init_kv_scales
from minisgl.engine.memory import graph_reserve_bytes, plan_num_pages
from minisgl.engine.sampler import PenaltyInputs, SampleOutput, SamplingInputs, sample, to_device
from minisgl.engine.warmup import run_warmup
from minisgl.kvcache import KVPool, ReqTable
from minisgl.layers import ForwardContext
from minisgl.models import build_model
from minisgl.weights import (
    ModelSource,
    init_dummy_weights,
    load_model_config,
    load_weights,
    resolve_source,
)
from minisgl.weights.fp8 import KVScales

if TYPE_CHECKING:
    from minisgl.engine.cuda_graph import CudaGraphRunner

logger = logging.getLogger(__name__)

# Environment switches (for benchmarks and bisecting): "1" turns the feature off.
ENV_DISABLE_OVERLAP = "MINISGL_DISABLE_OVERLAP"
ENV_DISABLE_CUDA_GRAPH = "MINISGL_DISABLE_CUDA_GRAPH"


@dataclass
class ForwardOutput:
    """Tokens sampled by one step, for the rows of the batch whose `sample` flag was set."""

    sample_rows: list[int]  # batch rows that sampled, in order
    tokens: torch.Tensor  # [S] int64 on the device
    tokens_host: torch.Tensor  # [S] int64 on the host (filled once `ready` has fired)
    logprobs_host: torch.Tensor | None
    top_ids_host: torch.Tensor | None
    top_logprobs_host: torch.Tensor | None
    ready: torch.cuda.Event | None  # None on the CPU: already complete

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


@dataclass
class StepRows:
    """Where the sampled rows of a step live: their hidden states and request-table cells."""

    hidden: torch.Tensor  # [S, hidden] final hidden state of each sampling row's last token
    req_slots: torch.Tensor  # [S] int64
    seq_lens: torch.Tensor  # [S] int64, the sampled token's position in the token table


class StepInputs(NamedTuple):
    """The device inputs of an eager step."""

    attn: AttentionInputs  # `out_loc` still empty
    positions: torch.Tensor  # [T] int64, position of each new token
    token_slots: torch.Tensor  # [T] int64, request slot of each new token
    seq_lens: torch.Tensor  # [B] int64
    cu_extend: torch.Tensor  # [B+1] int64


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def apply_env_switches(cfg: EngineConfig) -> EngineConfig:
    """`MINISGL_DISABLE_OVERLAP=1` / `MINISGL_DISABLE_CUDA_GRAPH=1` turn those features off."""
    if os.environ.get(ENV_DISABLE_OVERLAP) == "1":
        cfg = replace(cfg, overlap=False)
    if os.environ.get(ENV_DISABLE_CUDA_GRAPH) == "1":
        cfg = replace(cfg, cuda_graph_max_bs=0)
    return cfg


class Engine:
    """Owns the model, the KV pool and the request table; runs one batch per call.

    The scheduler builds a `Batch`, calls `forward_batch`, and reads back `ForwardOutput`.
    Every device operation of a step (input gathers, the model, sampling, the token-table write)
    and every host-to-device table write goes to one CUDA stream, in the order the host issues
    them. So the host may free a page or a request slot while a step that uses it still runs:
    whatever reuses it is enqueued later and runs after that step.
    """

    def __init__(self, config: EngineConfig) -> None:
        src = resolve_source(config.model)
        self.model_config: ModelConfig = load_model_config(src)
        self.config = apply_env_switches(resolve_engine_config(config, self.model_config.dtype))
        self.model_config = resolve_model_quantization(self.model_config, self.config)
        cfg, mcfg = self.config, self.model_config
        self.device = cfg.torch_device
        self.dtype = cfg.torch_dtype
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(cfg.seed)
        kv_scales = self._build_model(src)
        self.max_context = min(cfg.max_context_len or mcfg.max_position, mcfg.max_position)
        self._build_kv(src, kv_scales)
        self.graphs = self._capture_graphs()
        self.num_steps = 0  # batches run so far (the warm-up's included)
        if not cfg.skip_warmup:
            self.warmup()

    def _build_model(self, src: ModelSource) -> KVScales | None:
        """The model with its weights; returns the checkpoint's FP8 KV scales if it has any."""
        cfg = self.config
        with torch.device(self.device), _default_dtype(self.dtype):
            self.model = build_model(self.model_config)
        kv_scales = None
        if cfg.load_format == "dummy":
            init_dummy_weights(self.model, cfg.seed)
        else:
            kv_scales = load_weights(self.model, src, self.model_config)
        self.model.eval()
        return kv_scales

    def _build_kv(self, src: ModelSource, kv_scales: KVScales | None) -> None:
        cfg, mcfg = self.config, self.model_config
        attn = self.model.model.layers[0].self_attn  # type: ignore[union-attr,index]
        num_kv_heads, num_q_heads = attn.num_kv_heads, attn.num_heads
        self.table = ReqTable(
            cfg.max_running_requests, self.max_context, cfg.page_size, self.device
        )
        reserve = graph_reserve_bytes(cfg, mcfg, self.max_context) if self._wants_graphs() else 0
        self.num_pages = cfg.num_pages or plan_num_pages(
            cfg, mcfg, num_kv_heads, self.max_context, reserve
        )
        # One page more than the scheduler hands out: padding rows of a CUDA-graph batch write
        # their K/V there, never into a request's page.
        self.pool = KVPool(
            mcfg.num_layers,
            self.num_pages + 1,
            cfg.page_size,
            num_kv_heads,
            mcfg.head_dim,
            cfg.kv_torch_dtype,
            self.device,
        )
        sm_scale = mcfg.head_dim**-0.5
        init_kv_scales(
            self.pool, self.model, self.table, num_q_heads, sm_scale, cfg.kv_cache_calibrate,
            kv_scales, src, mcfg.vocab_size,
        )  # fmt: skip
        self.dummy_loc = self.num_pages * cfg.page_size
        self.backend = make_backend(
            cfg.attention_backend, self.pool, self.table, num_q_heads, sm_scale
        )
        logger.info(
            "KV pool: %d pages of %d tokens, %s", self.num_pages, cfg.page_size, cfg.kv_cache_dtype
        )

    def _wants_graphs(self) -> bool:
        """Decode CUDA graphs: on CUDA, unless disabled, with a backend that can be captured."""
        cfg = self.config
        on_cuda = self.device.type == "cuda"
        return cfg.cuda_graph_max_bs > 0 and on_cuda and cfg.attention_backend == "triton"

    def _capture_graphs(self) -> CudaGraphRunner | None:
        if not (self._wants_graphs() and self.backend.supports_cuda_graph):
            return None
        from minisgl.engine.cuda_graph import CudaGraphRunner

        return CudaGraphRunner(self)

    def warmup(self) -> None:
        """Run the start-up steps of `minisgl.engine.warmup` (every eager kernel variant that
        serving reaches), then wait for the device. Only on an engine without requests: the
        steps take request slots and write KV pages that no scheduler has handed out yet."""
        if self.num_steps:
            raise RuntimeError(
                "Engine.warmup runs before the first batch only: its steps overwrite KV pages "
                "that a scheduler may have handed out since"
            )
        start = time.perf_counter()
        steps = run_warmup(self)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info("warm-up: %d steps in %.2f s", steps, time.perf_counter() - start)

    @property
    def page_size(self) -> int:
        return self.config.page_size

    # ---- one step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def forward_batch(self, batch: Batch) -> ForwardOutput:
        self.num_steps += 1
        rows: StepRows | None
        if self.graphs is not None and self.graphs.can_run(batch):
            rows = self.graphs.run(batch)
        else:
            rows = self._run_eager(batch)
        return self._sample(batch, rows)

    def _run_eager(self, batch: Batch) -> StepRows | None:
        step = self._step_inputs(batch)
        inputs = step.attn
        input_ids = self.table.token_table[step.token_slots, step.positions]  # [T]
        inputs.out_loc = self.token_locations(step.token_slots, step.positions)
        ctx = ForwardContext(self.backend, self.backend.prepare(inputs))
        hidden = self.model(input_ids, step.positions, ctx)  # [T, hidden]
        rows = [i for i, s in enumerate(batch.sample) if s]
        if not rows:
            return None
        last = step.cu_extend[1:] - 1  # [B] row of each request's last new token
        slots, seq_lens = inputs.req_slots, step.seq_lens
        if len(rows) < batch.size:
            idx = to_device(rows, torch.int64, self.device)
            last, slots, seq_lens = last[idx], slots[idx], seq_lens[idx]
        return StepRows(hidden[last], slots, seq_lens)

    def token_locations(self, req_slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T] request slots, [T] positions -> [T] int64 KV slots (through the page table)."""
        ps = self.page_size
        pages = self.table.page_table[req_slots, positions // ps].long()
        return pages * ps + positions % ps

    def _step_inputs(self, batch: Batch) -> StepInputs:
        """The device inputs of an eager step, from one host-to-device copy of every
        per-request number of the step; per-token numbers are built on the device."""
        b, t = batch.size, batch.num_tokens
        prefix, ext, seq_lens_host = batch.prefix_lens, batch.extend_lens, batch.seq_lens
        cu = [0, *itertools.accumulate(ext)]
        slots = [r.slot for r in batch.reqs]
        assert None not in slots
        decode = t == b
        # New token i of request r is step row cu[r] + i at position prefix[r] + i: its row
        # plus shift[r]. (A host list of T positions cost 0.7 ms at T = 8,000: building it
        # and converting it to a tensor.) In a decode step the shift is the position.
        shift = prefix if decode else [p - c for p, c in zip(prefix, cu)]
        # Shifts first: in a decode step they are the positions, which the fused RoPE kernel
        # reads, and Triton compiles a kernel per pointer alignment (the buffer's start is
        # aligned; an offset of 8 * k bytes is not for odd k).
        host = shift + slots + seq_lens_host + prefix + ext + cu
        packed = to_device(host, torch.int64, self.device)
        per_req, seq_lens, prefix_t, ext_t, cu_t = packed.split([2 * b, b, b, b, b + 1])
        req_slots = per_req[b:]
        if decode:
            positions, token_slots = per_req[:b], req_slots
        else:
            # [2, T]: the shift and the request slot of each new token's request
            per_token = per_req.view(2, b).repeat_interleave(ext_t, dim=1, output_size=t)
            positions = torch.arange(t, device=self.device) + per_token[0]
            token_slots = per_token[1]
        inputs = AttentionInputs(
            req_slots=req_slots,
            seq_lens=seq_lens.int(),
            prefix_lens=prefix_t.int(),
            extend_lens=ext_t.int(),
            cu_extend=cu_t.int(),
            out_loc=torch.empty(0, dtype=torch.int64, device=self.device),
            is_decode=decode,
            seq_lens_host=seq_lens_host,
            extend_lens_host=list(ext),
        )
        return StepInputs(inputs, positions, token_slots, seq_lens, cu_t)

    def _attention_inputs(self, batch: Batch) -> AttentionInputs:
        return self._step_inputs(batch).attn

    def _positions(self, batch: Batch) -> torch.Tensor:
        return self._step_inputs(batch).positions

    # ---- sampling ----------------------------------------------------------------------------

    def _sample(self, batch: Batch, rows: StepRows | None) -> ForwardOutput:
        sample_rows = [i for i, s in enumerate(batch.sample) if s]
        if rows is None or not sample_rows:
            empty = torch.empty(0, dtype=torch.int64)
            return ForwardOutput([], empty.to(self.device), empty, None, None, None, None)
        logits = self.model.compute_logits(rows.hidden)  # type: ignore[operator]  # [S, V]
        reqs = [batch.reqs[i] for i in sample_rows]
        sin = SamplingInputs.build(reqs, self.model_config.vocab_size, self.device)
        if any(r.params.has_penalties for r in reqs):
            sin.penalties = self._penalties(reqs, rows)
        out = sample(logits, sin)
        # The sampled token becomes the input of the request's next step.
        self.table.token_table[rows.req_slots, rows.seq_lens] = out.tokens.int()
        return self._to_host(sample_rows, out)

    def _penalties(self, reqs: list[Req], rows: StepRows) -> PenaltyInputs:
        """Prompt and earlier output tokens, read from the token table on the device: with
        overlap scheduling the host does not know the previous step's token yet."""
        prompt_lens = [r.prompt_len for r in reqs]
        num_out = [r.num_sampled - 1 for r in reqs]  # outputs before the one being sampled
        plen = to_device(prompt_lens, torch.int64, self.device)

        def gather(start: torch.Tensor, lens: list[int]) -> torch.Tensor:
            width = max(1, max(lens))
            cols = start.unsqueeze(1) + torch.arange(width, device=self.device)  # [S, W]
            n = to_device(lens, torch.int64, self.device).unsqueeze(1)
            valid = cols < start.unsqueeze(1) + n
            cols = cols.clamp(max=self.table.token_table.shape[1] - 1)
            ids = self.table.token_table[rows.req_slots.unsqueeze(1), cols].long()
            return torch.where(valid, ids, -1)

        def f(vals: list[float]) -> torch.Tensor:
            return to_device(vals, torch.float32, self.device)

        return PenaltyInputs(
            prompt_tokens=gather(torch.zeros_like(plen), prompt_lens),
            output_tokens=gather(plen, num_out),
            presence=f([r.params.presence_penalty for r in reqs]),
            frequency=f([r.params.frequency_penalty for r in reqs]),
            repetition=f([r.params.repetition_penalty for r in reqs]),
        )

    def _to_host(self, rows: list[int], out: SampleOutput) -> ForwardOutput:
        on_cuda = self.device.type == "cuda"

        def host(x: torch.Tensor | None) -> torch.Tensor | None:
            if x is None:
                return None
            return x.to("cpu", non_blocking=True) if on_cuda else x

        ready = None
        tokens_host = host(out.tokens)
        assert tokens_host is not None
        lp, ti, tl = host(out.logprobs), host(out.top_ids), host(out.top_logprobs)
        if on_cuda:
            ready = torch.cuda.Event()
            ready.record()
        return ForwardOutput(rows, out.tokens, tokens_host, lp, ti, tl, ready)
