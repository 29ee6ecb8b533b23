"""A separate draft model for speculative decoding (`--speculative-draft-model PATH`): a smaller
model of the target's vocabulary with its own weights and KV pool.

The draft pool has the target pool's pages (same count, same page size) and is addressed through
the target's page table: the page a request holds for position p holds the draft's K/V of p in
the draft pool. Nothing in the scheduler changes: pages come and go for both pools at once.

What the draft pool holds is tracked per request-table slot (and admission: `SeqInfo`): the
number of leading positions whose draft K/V is there. Before a request drafts, the draft model
catches up over the positions it has not seen (the prompt on its first draft, the tokens of
plain decode steps since), in one extend step; its draft steps then write K/V at the last token
and at the drafts, of which those the verify step accepts stay valid. Stale K/V (a page another
request wrote, a prefix the radix cache shared) can only make the drafts worse: the verify step
decides every token, so outputs never depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.attention import make_backend
from minisgl.config import ModelConfig, resolve_model_quantization
from minisgl.core import Batch, SeqInfo
from minisgl.engine.cuda_graph import CudaGraphRunner, GraphHost, eager_forward
from minisgl.engine.model_loading import load_model
from minisgl.engine.step import step_inputs
from minisgl.kvcache import KVPool, ReqTable
from minisgl.weights import load_model_config, resolve_source


@dataclass
class _Seen:
    seq: SeqInfo  # the admission the count belongs to
    positions: int  # leading positions whose draft K/V is in the draft pool


class DraftModel:
    """The draft model, its pool and backend (and, on CUDA, its decode graphs). It has what
    `CudaGraphRunner` reads of an engine (`GraphHost`), over the target's (`engine`) request
    table and page table."""

    def __init__(self, engine: GraphHost, path: str) -> None:
        src = resolve_source(path)
        cfg = engine.config
        mcfg = resolve_model_quantization(load_model_config(src), cfg)
        if mcfg.vocab_size != engine.model_config.vocab_size:
            raise ValueError(
                f"speculative_draft_model: its vocabulary has {mcfg.vocab_size} tokens, the "
                f"target's {engine.model_config.vocab_size}: a draft must share the vocabulary"
            )
        self.engine = engine
        self.config = cfg
        self.model_config: ModelConfig = mcfg
        self.device, self.dtype = engine.device, engine.dtype
        self.model, _ = load_model(cfg, mcfg, src, cfg.seed + 1)
        attn = self.model.model.layers[0].self_attn  # type: ignore[union-attr,index]
        self.num_kv_heads, self.num_q_heads = attn.num_kv_heads, attn.num_heads
        self._seen: dict[int, _Seen] = {}
        self.graphs: CudaGraphRunner | None = None

    @property
    def table(self) -> ReqTable:
        return self.engine.table  # built after this model (the pool is planned with it)

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    def bytes_per_page(self) -> int:
        """Draft pool bytes per page of the target's pool."""
        mcfg, cfg = self.model_config, self.config
        return KVPool.bytes_per_page(
            mcfg.num_layers, cfg.page_size, self.num_kv_heads, mcfg.head_dim, self.dtype
        )

    def attach_pool(self, num_pages: int, max_graph_bs: int | None, capture: bool = True) -> None:
        """The draft pool of the target's page count (plus its spare page), its attention
        backend and, with `max_graph_bs` (CUDA graphs on), its decode graphs (`capture`
        False: run eagerly, as the engine's own runner in CPU tests)."""
        mcfg, cfg = self.model_config, self.config
        self.pool = KVPool(
            mcfg.num_layers,
            num_pages + 1,
            cfg.page_size,
            self.num_kv_heads,
            mcfg.head_dim,
            self.dtype,  # never FP8: the draft's K/V is small
            self.device,
        )
        self.dummy_loc = self.pool.spare_loc
        sm_scale = mcfg.head_dim**-0.5
        self.backend = make_backend(
            cfg.attention_backend,
            self.pool,
            self.table,
            self.num_q_heads,
            sm_scale,
            cfg.deterministic,
        )
        if max_graph_bs is not None and (self.backend.supports_cuda_graph or not capture):
            self.graphs = CudaGraphRunner(self, capture, max_graph_bs)

    def token_locations(self, req_slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.engine.token_locations(req_slots, positions)

    # ---- what the draft pool holds ------------------------------------------------------------

    def begin_step(self, batch: Batch) -> None:
        """Forget the counts of slots that another admission holds now."""
        for seq in batch.seqs:
            seen = self._seen.get(seq.slot)
            if seen is None or seen.seq is not seq:
                self._seen[seq.slot] = _Seen(seq, 0)

    def seen(self, slot: int) -> int:
        entry = self._seen.get(slot)
        return 0 if entry is None else entry.positions

    def verified(self, slot: int, last: int, drafts: int, kept: int) -> None:
        """A verify row of `slot` whose last token was at position `last` drafted `drafts`
        tokens and kept `kept` of them: the draft steps wrote K/V at last .. last + drafts - 1,
        valid up to the last kept draft."""
        entry = self._seen.get(slot)
        if entry is not None and drafts:
            entry.positions = last + 1 + min(kept, drafts - 1)

    # ---- steps ------------------------------------------------------------------------------

    @torch.inference_mode()
    def catch_up(self, slots: list[int], seq_lens: list[int]) -> None:
        """Run the draft over each row's positions it has not seen, up to the one before the
        row's last token (which its first draft step takes)."""
        rows = [(s, self.seen(s), n - 1) for s, n in zip(slots, seq_lens) if self.seen(s) < n - 1]
        if not rows:
            return
        step = step_inputs(
            [s for s, _, _ in rows],
            [a for _, a, _ in rows],
            [b - a for _, a, b in rows],
            self.device,
        )
        eager_forward(self, step)
        for s, _, b in rows:
            self._seen[s].positions = b
