from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import replace

import torch

from minisgl.attention import AttentionInputs, make_backend
from minisgl.config import (
    EngineConfig,
    ModelConfig,
    apply_env_switches,
    resolve_engine_config,
    resolve_model_quantization,
)
from minisgl.core import Batch, SeqInfo
from minisgl.engine.cuda_graph import CudaGraphRunner, eager_forward
from minisgl.engine.draft_model import DraftModel
from minisgl.engine.kv_calibration import init_kv_scales
from minisgl.engine.memory import graph_reserve_bytes, piecewise_reserve_bytes, plan_num_pages
from minisgl.engine.model_loading import load_model
from minisgl.engine.piecewise import PiecewiseGraphRunner
from minisgl.engine.sampler import (
    LogitBias,
    PenaltyInputs,
    SampleOutput,
    SamplingInputs,
    StopMask,
    sample,
    to_device,
)
from minisgl.engine.speculative import make_device_proposer, verify_step
from minisgl.engine.step import ForwardOutput, StepInputs, StepRows, TokenMask
from minisgl.kvcache import KVPool, ReqTable
from minisgl.weights import (
    ModelSource,
    load_model_config,
    resolve_source,
)
from minisgl.weights.fp8 import KVScales

logger = logging.getLogger(__name__)


class Engine:
    """Owns the model and every device tensor (KV pool, request table, CUDA graphs); runs
    one step per call.

    The scheduler hands `forward_batch` a step plan (`Batch`): its rows, and the request-table
    writes queued since the previous plan, which the engine applies before the step's kernels.
    It reads back `ForwardOutput`, whose `ready` event fires once the step has completed on the
    device; the scheduler gives a released request's pages and slot to another request only
    after that (so no reuse depends on how the device orders its work).
    """

    def __init__(
        self, config: EngineConfig, agree_num_pages: Callable[[int], int] | None = None
    ) -> None:
        """`agree_num_pages` (tensor parallelism) gets the page count this rank's memory holds
        and returns the count every rank uses (the runtime passes the minimum over the ranks):
        the pool and the CUDA graphs are then built for it, the same on every rank.
        """
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
        # A draft model's weights count before the pool is planned; its pool comes later.
        self.draft_model: DraftModel | None = None
        if cfg.speculative_draft_model is not None:
            self.draft_model = DraftModel(self, cfg.speculative_draft_model)
        self._build_kv(agree_num_pages, src, kv_scales)
        self.graphs = self._capture_graphs()
        self.pieces = self._capture_pieces()
        # Speculative decoding's device proposer (the layer-skip draft), if configured.
        self.drafter = make_device_proposer(self)
        self.num_steps = 0  # batches run so far (the warm-up's included)

    def _build_model(self, src: ModelSource) -> KVScales | None:
        """The model with its weights; returns the checkpoint's FP8 KV scales if it has any."""
        self.model, kv_scales = load_model(self.config, self.model_config, src, self.config.seed)
        return kv_scales

    def _build_kv(
        self,
        agree_num_pages: Callable[[int], int] | None,
        src: ModelSource,
        kv_scales: KVScales | None,
    ) -> None:
        cfg, mcfg = self.config, self.model_config
        attn = self.model.model.layers[0].self_attn  # type: ignore[union-attr,index]
        num_kv_heads, num_q_heads = attn.num_kv_heads, attn.num_heads
        self.table = ReqTable(
            cfg.max_running_requests, self.max_context, cfg.page_size, self.device
        )
        reserve = graph_reserve_bytes(cfg, mcfg, self.max_context) if self._wants_graphs() else 0
        if self._wants_pieces():
            reserve += piecewise_reserve_bytes(cfg, mcfg)
        draft = 0 if self.draft_model is None else self.draft_model.bytes_per_page()
        own = cfg.num_pages or plan_num_pages(
            cfg, mcfg, num_kv_heads, self.max_context, reserve, draft
        )
        self.num_pages = agree_num_pages(own) if agree_num_pages else own
        self.config = cfg = replace(cfg, num_pages=self.num_pages)
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
        self.dummy_loc = self.pool.spare_loc
        self.backend = make_backend(
            cfg.attention_backend, self.pool, self.table, num_q_heads, sm_scale
        )
        agreed = f" (the ranks' minimum; this rank's budget holds {own})" if agree_num_pages else ""
        logger.info("KV pool: %d pages of %d tokens%s", self.num_pages, cfg.page_size, agreed)

    def _wants_graphs(self) -> bool:
        """Decode CUDA graphs: on CUDA, unless disabled, with a backend that can be captured."""
        cfg = self.config
        on_cuda = self.device.type == "cuda"
        return cfg.cuda_graph_max_bs > 0 and on_cuda and cfg.attention_backend == "triton"

    def _capture_graphs(self) -> CudaGraphRunner | None:
        if not (self._wants_graphs() and self.backend.supports_cuda_graph):
            return None
        return CudaGraphRunner(self)

    def _wants_pieces(self) -> bool:
        """Piecewise graphs for prefilling steps: with the decode graphs, at tp = 1, for a
        dense model (a mixture of experts routes on host-side numbers)."""
        cfg, dense = self.config, self.model_config.moe is None
        wanted = cfg.piecewise_graph_max_tokens > 0 and cfg.tp_size == 1 and dense
        return wanted and self._wants_graphs()

    def _capture_pieces(self) -> PiecewiseGraphRunner | None:
        if not (self._wants_pieces() and self.backend.supports_cuda_graph):
            return None
        cfg = self.config
        whole = cfg.piecewise_whole_step and self.backend.supports_mixed_step
        return PiecewiseGraphRunner(self, cfg.piecewise_graph_max_tokens, whole_step=whole)

    @property
    def page_size(self) -> int:
        return self.config.page_size

    @property
    def graph_tokens(self) -> int:
        """The most tokens a prefilling step may have and still replay a graph (0: none does)."""
        return self.pieces.max_tokens if self.pieces is not None else 0

    # ---- one step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def forward_batch(
        self, batch: Batch, mask: Callable[[], TokenMask] | None = None
    ) -> ForwardOutput:
        """Apply the plan's table writes, run its step, sample; returns without waiting.

        `mask` (a step with constrained rows) is called once the model's work is launched and
        before sampling: the caller may still be learning the previous step's tokens, which
        the mask depends on, while the device runs this one.
        """
        self.num_steps += 1
        if self.config.debug_kv:
            self.pool.poison(batch.freed_pages)
        self.table.apply(batch.page_writes, batch.token_writes)
        if self.draft_model is not None:
            self.draft_model.begin_step(batch)
        if batch.speculative:  # eager, and its tokens are on the host when it returns
            return verify_step(self, batch, mask)
        rows: StepRows | None
        if self.graphs is not None and self.graphs.can_run(batch):
            rows = self.graphs.run(batch)
        elif self.pieces is not None and self.pieces.can_run(batch):
            rows = self.pieces.run(batch)
        else:
            rows = self._run_eager(batch)
        return self._sample(batch, rows, mask)

    def _run_eager(self, batch: Batch) -> StepRows | None:
        step = self._step_inputs(batch)
        return self.sampled_rows(batch, step, self.eager_forward(step))

    def eager_forward(self, step: StepInputs, num_layers: int | None = None) -> torch.Tensor:
        """The model on a step's inputs, launched eagerly -> final hidden states [T, hidden]
        (`num_layers`: the first layers only, then the final norm: a layer-skip draft)."""
        return eager_forward(self, step, num_layers)

    def sampled_rows(self, batch: Batch, step: StepInputs, hidden: torch.Tensor) -> StepRows | None:
        """The rows of the step's final hidden states [T, hidden] that sample (each such
        request's last new token), with their request slots and context lengths."""
        rows = [i for i, s in enumerate(batch.sample) if s]
        if not rows:
            return None
        inputs = step.attn
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
        return self.step_inputs(batch.slots, batch.prefix_lens, batch.extend_lens)

    def step_inputs(self, slots: list[int], prefix: list[int], ext: list[int]) -> StepInputs:
        """The device inputs of an eager step (rows: request slot, tokens already in KV, new
        tokens), from one host-to-device copy of every per-request number of the step;
        per-token numbers are built on the device."""
        b, t = len(slots), sum(ext)
        seq_lens_host = [p + e for p, e in zip(prefix, ext)]
        cu = [0, *itertools.accumulate(ext)]
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

    def _sample(
        self, batch: Batch, rows: StepRows | None, mask: Callable[[], TokenMask] | None
    ) -> ForwardOutput:
        sample_rows = [i for i, s in enumerate(batch.sample) if s]
        if rows is None or not sample_rows:
            empty = torch.empty(0, dtype=torch.int64)
            return ForwardOutput([], empty.to(self.device), empty, None, None, None, None)
        logits = self.model.compute_logits(rows.hidden)  # type: ignore[operator]  # [S, V]
        seqs = [batch.seqs[i] for i in sample_rows]
        out_index = [batch.out_index[i] for i in sample_rows]
        sin = SamplingInputs.build(seqs, out_index, self.model_config.vocab_size, self.device)
        if any(s.params.has_penalties for s in seqs):
            sin.penalties = self._penalties(seqs, out_index, rows)
        if any(s.params.min_tokens for s in seqs):  # out_index: outputs before this one
            pending = [n < s.params.min_tokens for s, n in zip(seqs, out_index)]
            stop_ids = [s.stop_ids for s in seqs]
            sin.stop_mask = StopMask.build(pending, stop_ids, logits.shape[1], self.device)
        if any(s.params.logit_bias for s in seqs):
            biases = [s.params.logit_bias for s in seqs]
            sin.logit_bias = LogitBias.build(biases, logits.shape[1], self.device)
        if mask is not None:
            sin.token_mask = mask().to(self.device)
        out = sample(logits, sin)
        # The sampled token becomes the input of the request's next step.
        self.table.token_table[rows.req_slots, rows.seq_lens] = out.tokens.int()
        return self._to_host(sample_rows, out)

    def _penalties(self, seqs: list[SeqInfo], num_out: list[int], rows: StepRows) -> PenaltyInputs:
        """Prompt and the `num_out` earlier output tokens of each row, read from the token
        table on the device: with overlap scheduling the host does not know the previous
        step's token yet."""
        prompt_lens = [s.prompt_len for s in seqs]
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
            presence=f([s.params.presence_penalty for s in seqs]),
            frequency=f([s.params.frequency_penalty for s in seqs]),
            repetition=f([s.params.repetition_penalty for s in seqs]),
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
