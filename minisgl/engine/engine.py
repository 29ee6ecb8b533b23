from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from minisgl.attention import make_backend
from minisgl.config import (
    EngineConfig,
    ModelConfig,
    apply_env_switches,
    resolve_engine_config,
    resolve_model_quantization,
)
from minisgl.core import Batch
from minisgl.distributed import get_tp_info
from minisgl.engine.cuda_graph import CudaGraphRunner, eager_forward
from minisgl.engine.draft_model import DraftModel
from minisgl.engine.kv_calibration import init_kv_scales
from minisgl.engine.kv_tier import TierCopier, make_tier_copier
from minisgl.engine.memory import graph_reserve_bytes, piecewise_reserve_bytes, plan_num_pages
from minisgl.engine.model_loading import load_model
from minisgl.engine.piecewise import PiecewiseGraphRunner
from minisgl.engine.sampler import SampleOutput, sample, sampling_inputs
from minisgl.engine.speculative import make_device_proposer, verify_step
from minisgl.engine.step import (
    ForwardOutput,
    StepInputs,
    StepRows,
    TokenMask,
    batch_inputs,
    to_device,
)
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
        started = time.perf_counter()
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
        # The KV host (and disk) tier's pages and copies (None: off).
        self.tier: TierCopier | None = make_tier_copier(
            self.pool, cfg.kv_host_gib, cfg.kv_disk_dir, cfg.kv_disk_gib, get_tp_info().rank
        )
        captured = time.perf_counter()
        self.graphs = self._capture_graphs()
        self.pieces = self._capture_pieces()
        # For the start-up summary (`minisgl.engine.startup`).
        self.graphs_s = time.perf_counter() - captured
        self.load_s = time.perf_counter() - started
        decode = len(self.graphs.sizes) if self.graphs is not None and self.graphs.captured else 0
        pieces = self.pieces
        self.num_graphs = decode + (len(pieces.pieces) + len(pieces.whole) if pieces else 0)
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
            cfg.attention_backend,
            self.pool,
            self.table,
            num_q_heads,
            sm_scale,
            cfg.deterministic,
        )
        agreed = f" (the ranks' minimum; this rank's budget holds {own})" if agree_num_pages else ""
        # The start-up summary (`minisgl.engine.startup`) says it once; this line says how the
        # tensor-parallel ranks agreed.
        level = logging.INFO if agree_num_pages else logging.DEBUG
        logger.log(level, "KV pool: %d pages of %d tokens%s", self.num_pages, cfg.page_size, agreed)

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
    def tier_pages(self) -> tuple[int, int]:
        """(host pages, disk pages) of the KV tier; (0, 0) when it is off."""
        if self.tier is None:
            return 0, 0
        return self.tier.host_pages, self.tier.disk_pages

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
        if batch.page_copies:  # before the poison: a page written back is read first
            assert self.tier is not None, "page copies without --kv-host-gib"
            self.tier.run(batch.page_copies, after_compute=self.config.debug_kv)
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
        step = batch_inputs(batch, self.device)
        return self.sampled_rows(batch, step, eager_forward(self, step))

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
        table, vocab = self.table.token_table, self.model_config.vocab_size
        out = sample(logits, sampling_inputs(seqs, out_index, rows.req_slots, table, vocab, mask))
        # The sampled token becomes the input of the request's next step.
        table[rows.req_slots, rows.seq_lens] = out.tokens.int()
        return self._to_host(sample_rows, out)

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
