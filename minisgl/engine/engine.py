from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from minisgl.attention import AttentionInputs, make_backend
from minisgl.config import EngineConfig, ModelConfig, resolve_engine_config
from minisgl.core import Batch
from minisgl.engine.memory import plan_num_pages
from minisgl.engine.sampler import PenaltyInputs, SampleOutput, SamplingInputs, sample
from minisgl.kvcache import KVPool, ReqTable
from minisgl.layers import ForwardContext
from minisgl.models import build_model
from minisgl.weights import init_dummy_weights, load_model_config, load_weights, resolve_source

logger = logging.getLogger(__name__)


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


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class Engine:
    """Owns the model, the KV pool and the request table; runs one batch per call.

    The scheduler builds a `Batch`, calls `forward_batch`, and reads back `ForwardOutput`.
    """

    def __init__(self, config: EngineConfig) -> None:
        src = resolve_source(config.model)
        self.model_config: ModelConfig = load_model_config(src)
        self.config = resolve_engine_config(config, self.model_config.dtype)
        cfg, mcfg = self.config, self.model_config
        self.device = cfg.torch_device
        self.dtype = cfg.torch_dtype
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(cfg.seed)
        with torch.device(self.device), _default_dtype(self.dtype):
            self.model = build_model(mcfg)
        if cfg.load_format == "dummy":
            init_dummy_weights(self.model, cfg.seed)
        else:
            load_weights(self.model, src, mcfg)
        self.model.eval()
        self.max_context = min(cfg.max_context_len or mcfg.max_position, mcfg.max_position)
        attn = self.model.model.layers[0].self_attn  # type: ignore[union-attr,index]
        num_kv_heads, num_q_heads = attn.num_kv_heads, attn.num_heads
        self.table = ReqTable(
            cfg.max_running_requests, self.max_context, cfg.page_size, self.device
        )
        self.num_pages = cfg.num_pages or plan_num_pages(cfg, mcfg, num_kv_heads, self.max_context)
        self.pool = KVPool(
            mcfg.num_layers,
            self.num_pages,
            cfg.page_size,
            num_kv_heads,
            mcfg.head_dim,
            self.dtype,
            self.device,
        )
        self.backend = make_backend(
            cfg.attention_backend, self.pool, self.table, num_q_heads, mcfg.head_dim**-0.5
        )
        logger.info("KV pool: %d pages of %d tokens", self.num_pages, cfg.page_size)

    @property
    def page_size(self) -> int:
        return self.config.page_size

    @torch.inference_mode()
    def forward_batch(self, batch: Batch) -> ForwardOutput:
        inputs = self._attention_inputs(batch)
        positions = self._positions(batch)
        slot_of_token = torch.repeat_interleave(
            inputs.req_slots, inputs.extend_lens.long(), output_size=batch.num_tokens
        )
        input_ids = self.table.token_table[slot_of_token, positions]  # [T]
        ps = self.page_size
        pages = self.table.page_table[slot_of_token, positions // ps].long()
        inputs.out_loc = pages * ps + positions % ps  # [T]
        ctx = ForwardContext(self.backend, self.backend.prepare(inputs))
        hidden = self.model(input_ids, positions, ctx)  # [T, hidden]
        return self._sample(batch, inputs, hidden)

    def _attention_inputs(self, batch: Batch) -> AttentionInputs:
        dev = self.device
        seq_lens = batch.seq_lens
        ext = batch.extend_lens
        cu = [0]
        for e in ext:
            cu.append(cu[-1] + e)

        def t(vals: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(vals, dtype=dtype).to(dev, non_blocking=True)

        slots = [r.slot for r in batch.reqs]
        assert all(s is not None for s in slots)
        return AttentionInputs(
            req_slots=t(slots, torch.int64),  # type: ignore[arg-type]
            seq_lens=t(seq_lens, torch.int32),
            prefix_lens=t(batch.prefix_lens, torch.int32),
            extend_lens=t(ext, torch.int32),
            cu_extend=t(cu, torch.int32),
            out_loc=torch.empty(0, dtype=torch.int64, device=dev),
            is_decode=all(e == 1 for e in ext),
            seq_lens_host=seq_lens,
            extend_lens_host=list(ext),
        )

    def _positions(self, batch: Batch) -> torch.Tensor:
        if all(e == 1 for e in batch.extend_lens):
            pos = torch.tensor(batch.prefix_lens, dtype=torch.int64)
        else:
            pos = torch.cat(
                [torch.arange(p, p + e) for p, e in zip(batch.prefix_lens, batch.extend_lens)]
            )
        return pos.to(self.device, non_blocking=True)

    def _sample(self, batch: Batch, inputs: AttentionInputs, hidden: torch.Tensor) -> ForwardOutput:
        rows = [i for i, s in enumerate(batch.sample) if s]
        if not rows:
            empty = torch.empty(0, dtype=torch.int64)
            return ForwardOutput(rows, empty.to(self.device), empty, None, None, None, None)
        last = inputs.cu_extend[1:].long() - 1  # [B] row of each request's last new token
        row_idx = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
        logits = self.model.compute_logits(hidden[last[row_idx]])  # type: ignore[operator]
        reqs = [batch.reqs[i] for i in rows]
        sin = SamplingInputs.build(reqs, self.model_config.vocab_size, self.device)
        if any(r.params.has_penalties for r in reqs):
            sin.penalties = self._penalties(reqs)
        out = sample(logits, sin)
        # The sampled token becomes the input of the request's next step.
        seq_lens = inputs.seq_lens[row_idx].long()
        self.table.token_table[inputs.req_slots[row_idx], seq_lens] = out.tokens.int()
        return self._to_host(rows, out)

    def _penalties(self, reqs: list) -> PenaltyInputs:
        def pad(rows: list[list[int]]) -> torch.Tensor:
            width = max(1, max(len(r) for r in rows))
            t = torch.full((len(rows), width), -1, dtype=torch.int64)
            for i, r in enumerate(rows):
                t[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
            return t.to(self.device, non_blocking=True)

        def f(vals: list[float]) -> torch.Tensor:
            return torch.tensor(vals, dtype=torch.float32).to(self.device, non_blocking=True)

        return PenaltyInputs(
            prompt_tokens=pad([r.prompt_ids for r in reqs]),
            output_tokens=pad([r.output_ids for r in reqs]),
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
