"""Start-up warm-up: a few synthetic steps through `Engine.forward_batch`, so that a fresh server
does not compile Triton kernels (nor load CUDA modules or grow the allocator) mid-serving. The
scheduler runs them once per engine, before its first request.

Triton compiles a variant of a kernel per set of constexprs, per 16-byte alignment of each
pointer argument, and per integer argument that is 1 or a multiple of 16 (unless the kernel
lists it in `do_not_specialize`). CUDA-graph capture runs the decode step at the captured batch
sizes; everything eager compiles on first use. The steps below reach each eager path once, in
the order the scheduler builds batches (one-token decode rows first, then prefill chunks):

1. prefill of two requests, one greedy and one sampling with a temperature (Gumbel kernel);
   the first has most of its prompt in a (synthetic) prefix-cache hit;
2. mixed: both decode, the long one past one decode split (so the split-K decode kernel and
   its reduction compile), then two prefill rows, the first a chunk that samples nothing, the
   second with top-k / top-p / min-p, penalties and log-probs (the sort-based sampler);
3. prefill of the chunk's rest, alone, from a prefix that does not end on a page boundary;
4. decode of short contexts (the single-split decode kernel), eager without CUDA graphs, two of
   its rows under a grammar's token mask (the mask kernel, with the Gumbel and sort samplers), then
   a decode of one request alone (the batch-1 GEMV path of the layers);
5. with CUDA graphs, an eager decode batch one request above the largest captured size; and
   for a model whose layers take the skinny GEMM up to N rows (`skinny_max_rows`, so every
   step above has run that way), a prefill of N + 1 tokens through its plain layers;
6. a model with MoE layers on CUDA: one prefill per power of two up to the prefill budget. The
   fused MoE kernels pick their tiles by tokens per expert (T * top_k / num_experts) in buckets
   bounded by powers of two, so these reach every bucket when num_experts / top_k is a power
   of two. The largest prefill is most of the warm-up's time (not measured yet; by its FLOPs
   about 0.1 s for an 8,192-token prefill of a 3B-active model on an H200).

Prompt lengths are not multiples of 16, token counts per step are both odd and even, and
batches hold one and several requests. The synthetic requests take slots and pages from
allocators of their own (no request holds any yet) and write their rows of the request table
through the step plans, as the scheduler does; whoever takes a slot later rewrites its rows.
Every tensor-parallel rank runs the same steps (they depend on the config only, unless the
KV pool is too small for them), so the model's collectives line up.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from minisgl.constrain import bitmask_width
from minisgl.core import Batch, Req, SamplingParams, SeqInfo, TableWrite, pages_for, plan_step
from minisgl.engine import Engine, ForwardOutput, TokenMask
from minisgl.kvcache import PageAllocator, SlotAllocator
from minisgl.layers.fused import fused_kernels

logger = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0.0)
TEMPERATURE = SamplingParams(temperature=0.8)
# Every filter and extra of the torch sampling path in one request.
FILTERED = SamplingParams(
    temperature=0.8,
    top_p=0.9,
    top_k=8,
    min_p=0.05,
    presence_penalty=0.5,
    frequency_penalty=0.5,
    repetition_penalty=1.1,
    logprobs=True,
    top_logprobs=2,
)
MIN_SLOTS = 4  # requests alive at once in steps 1-4


@dataclass(frozen=True)
class WarmupSizes:
    """Prompt lengths of the synthetic requests of steps 1-4."""

    long: int  # its decode context passes one decode split
    long_cached: int  # of which a prefix-cache hit holds this many (no prefill budget needed)
    short: int
    chunks: tuple[int, int]  # a prompt computed in two steps
    filtered: int

    @property
    def contexts(self) -> list[int]:
        """Tokens each request holds at the end (prompt plus sampled tokens)."""
        return [self.long + 1, self.short + 3, sum(self.chunks) + 1, self.filtered + 1]


def plan_sizes(
    split_tokens: int | None, max_prefill_tokens: int, max_context: int
) -> WarmupSizes | None:
    """Lengths for steps 1-4, or None when the limits leave no room for a prefill of two tokens.

    `split_tokens`: the context length past which the decode kernel splits (Triton backend),
    None for a backend without one. A step computes at most `max_prefill_tokens` prompt tokens,
    as the scheduler's would, so the activations stay within what the memory plan reserved.
    Lengths are short: their cost shows in the CPU tests, where Triton's interpreter runs every
    kernel.
    """
    cap = min(max_prefill_tokens // 2, (max_context - 3) // 2)  # per prefill row of a step
    if cap < 2:
        return None
    long = min((split_tokens or 8) + 1, max_context - 2)
    return WarmupSizes(
        long, long - min(6, cap), min(5, cap), (min(7, cap), min(3, cap)), min(3, cap)
    )


class WarmupRun:
    """Synthetic requests on private slot and page allocators."""

    def __init__(self, engine: Engine, allocator: PageAllocator) -> None:
        self.engine = engine
        self.allocator = allocator
        self.slots = SlotAllocator(engine.config.max_running_requests)
        self.reqs: list[Req] = []
        self.pages: list[int] = []  # in the order the allocator handed them out
        self.page_writes: list[TableWrite] = []  # for the next step's plan
        self.token_writes: list[TableWrite] = []
        self.steps = 0
        self.last: ForwardOutput | None = None  # of the step launched last

    def add(self, prompt_len: int, params: SamplingParams, cached: int = 0) -> Req:
        """A request admitted with its first `cached` tokens' KV in place, as after a prefix
        cache hit (what those pages hold does not matter here)."""
        n = len(self.reqs)
        vocab = self.engine.model_config.vocab_size
        ids = [(7919 * n + 131 * i + 3) % vocab for i in range(prompt_len)]
        req = Req(f"warmup-{n}", ids, params, seed=n + 1)
        req.seq = SeqInfo(self.slots.alloc(1)[0], params, req.seed, prompt_len)
        self.token_writes.append(TableWrite(req.seq.slot, 0, ids))
        self._grow(req, cached)
        req.num_computed = cached
        self.reqs.append(req)
        return req

    def step(self, rows: list[tuple[Req, int]], masked: tuple[Req, ...] = ()) -> Batch:
        """One batch as the scheduler builds it: (request, new tokens) rows, decodes first;
        the `masked` rows sample under a grammar's token mask (one that allows everything).
        Returns the step's plan."""
        reqs, extend = [r for r, _ in rows], [n for _, n in rows]
        sample = [r.num_computed + n == r.seq_len for r, n in rows]

        def writes() -> dict[str, Any]:
            out = {"token_writes": self.token_writes, "page_writes": self.page_writes}
            self.token_writes, self.page_writes = [], []
            return out

        batch = plan_step(reqs, extend, sample, self._grow, writes)
        mask = None
        if masked:
            sampling = [r for r, s in zip(reqs, sample) if s]
            vocab = self.engine.model_config.vocab_size
            bits = torch.full((len(sampling), bitmask_width(vocab)), -1, dtype=torch.int32)
            mask_rows = [i for i, r in enumerate(sampling) if r in masked]

            def mask() -> TokenMask:
                return TokenMask(bits, mask_rows)

        # Nothing reads the tokens back: the next step takes its inputs from the token table.
        self.last = self.engine.forward_batch(batch, mask)
        self.steps += 1
        return batch

    def _grow(self, req: Req, tokens: int) -> None:
        need = pages_for(tokens, self.engine.page_size) - len(req.pages)
        if need > 0:
            new = self.allocator.alloc(need)
            assert req.slot is not None
            self.page_writes.append(TableWrite(req.slot, len(req.pages), new))
            req.pages.extend(new)
            self.pages.extend(new)

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """Everything the steps inside take is given back at the end (also on an error)."""
        try:
            yield
        finally:
            self.release()

    def release(self) -> None:
        """Give back every slot and page, last taken first (the free lists end as they began),
        once the steps that used them have completed."""
        if self.last is not None:
            self.last.wait()
        self.allocator.free(reversed(self.pages))
        for req in reversed(self.reqs):
            assert req.slot is not None
            self.slots.free([req.slot])
            req.seq, req.pages = None, []
        self.reqs, self.pages = [], []


def run_warmup(engine: Engine, allocator: PageAllocator | None = None) -> int:
    """Run the warm-up steps on an engine without requests; returns how many ran (0: the limits
    left no room). `allocator`: where pages come from (default: a new one over the whole pool)."""
    run = WarmupRun(engine, allocator or PageAllocator(engine.num_pages))
    sizes = fitting_sizes(run)
    if sizes is None:
        logger.info("warm-up skipped: the limits (slots, pages, prefill budget) are too small")
        return 0
    with run.released():
        mixed_steps(run, sizes)
    with run.released():
        eager_decode_step(run)
    with run.released():
        plain_layers_step(run)
    if engine.model_config.moe is not None and engine.device.type == "cuda":
        moe_sweep(run, engine.config.max_prefill_tokens)
    return run.steps


def fitting_sizes(run: WarmupRun) -> WarmupSizes | None:
    """`plan_sizes` for the engine, or None if steps 1-4 need more slots or pages than it has."""
    e = run.engine
    decode_config = getattr(e.backend, "decode_config", None)
    split_tokens = getattr(decode_config, "min_split_tokens", None)
    sizes = plan_sizes(split_tokens, e.config.max_prefill_tokens, e.max_context)
    if sizes is None or e.config.max_running_requests < MIN_SLOTS:
        return None
    if sum(pages_for(n, e.page_size) for n in sizes.contexts) > run.allocator.num_free:
        return None
    return sizes


def mixed_steps(run: WarmupRun, sizes: WarmupSizes) -> None:
    """Steps 1-4 of the module docstring."""
    c1, c2 = sizes.chunks
    a = run.add(sizes.long, GREEDY, cached=sizes.long_cached)
    b = run.add(sizes.short, TEMPERATURE)
    run.step([(a, sizes.long - sizes.long_cached), (b, sizes.short)])
    c = run.add(c1 + c2, TEMPERATURE)
    d = run.add(sizes.filtered, FILTERED)
    run.step([(a, 1), (b, 1), (c, c1), (d, sizes.filtered)])
    run.step([(c, c2)])
    run.step([(b, 1), (c, 1), (d, 1)], masked=(b, d))
    run.step([(b, 1)])


def eager_decode_step(run: WarmupRun) -> None:
    """Step 5: with CUDA graphs, a decode batch of one-token prompts one above the largest
    graph (when the scheduler can run that many requests and the pool has a page for each)."""
    e = run.engine
    if e.graphs is None or e.graphs.max_bs >= e.config.max_running_requests:
        return
    n = e.graphs.max_bs + 1
    if n <= run.allocator.num_free:
        run.step([(run.add(1, GREEDY), 1) for _ in range(n)])


def plain_layers_step(run: WarmupRun) -> None:
    """Step 5's prefill of one row above the skinny GEMM's `skinny_max_rows` (when the prefill
    budget, the context and the pool allow it)."""
    e = run.engine
    if fused_kernels(torch.empty(0, device=e.device)) is None:  # no skinny GEMM here
        return
    n = e.model_config.skinny_max_rows + 1
    fits = n <= min(e.config.max_prefill_tokens, e.max_context - 1)
    if n > 1 and fits and pages_for(n + 1, e.page_size) <= run.allocator.num_free:
        run.step([(run.add(n, GREEDY), n)])


def moe_token_counts(max_prefill_tokens: int) -> list[int]:
    """Step 6's prefill sizes: the powers of two below the budget, and the budget. (One token
    is a decode-shaped step: a CUDA graph's, unless graphs are off.)"""
    counts, n = [], 1
    while n < max_prefill_tokens:
        counts.append(n)
        n *= 2
    return [*counts, max_prefill_tokens]


def moe_sweep(run: WarmupRun, max_prefill_tokens: int) -> None:
    """Step 6: one single-request prefill per size of `moe_token_counts` that fits."""
    e = run.engine
    for n in moe_token_counts(max_prefill_tokens):
        if n + 1 > e.max_context or pages_for(n, e.page_size) > run.allocator.num_free:
            return
        with run.released():
            run.step([(run.add(n, GREEDY), n)])
