"""Continuous batching with chunked prefill, KV reservation and retraction."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from minisgl.config import EngineConfig
from minisgl.core import (
    Batch,
    FinishReason,
    Req,
    ReqStatus,
    SamplingParams,
    pages_for,
    plan_step,
    resolve_max_tokens,
)
from minisgl.engine import Engine, ForwardOutput, TokenMask
from minisgl.kvcache import HostTier, PageAllocator, SlotAllocator, make_prefix_cache
from minisgl.scheduler.budget import PrefillBudget, token_budget
from minisgl.scheduler.calibrate import calibrate
from minisgl.scheduler.grammars import Grammars
from minisgl.scheduler.kv_manager import KVManager
from minisgl.scheduler.policy import SchedulePolicy, WaitingQueue
from minisgl.scheduler.step_time import LinearStepTime, StepShape, StepTimeModel
from minisgl.scheduler.sync import RequestSync
from minisgl.scheduler.timing import Sample, StepTimer
from minisgl.scheduler.warmup import run_warmup
from minisgl.spec import DraftPlanner
from minisgl.weights import load_tokenizer, resolve_source

logger = logging.getLogger(__name__)

GRAMMAR_POLL_S = 0.01  # how long an idle loop waits for a grammar to compile before looking again
QUEUE_TIMES_KEPT = 4096  # queue-time observations kept until /metrics takes them
PRIORITIES_COUNTED = 16  # retractions are counted per priority for this many priorities


class Step(NamedTuple):
    """A launched step, as the scheduler remembers it until its results are processed."""

    number: int  # launch order, from 1
    reqs: list[Req]  # the request of each row of `batch`
    batch: Batch
    out: ForwardOutput
    shape: StepShape


@dataclass
class StepEvent:
    """What one step produced for one request."""

    req: Req
    new_tokens: list[int]
    finished: bool


class Scheduler:
    """Decides each step's batch and turns sampled tokens into request progress.

    Every step carries one token for each decoding request plus prefill chunks (newest
    admissions last) within the budget of `minisgl.scheduler.budget`: a token limit, and while
    requests decode, the inter-token latency target as the step-time model (`step_model`,
    fitted at start-up and refined from every measured step, `minisgl.scheduler.timing`)
    predicts it. The waiting queue's order and who gives way when KV runs short follow the
    schedule policy (`minisgl.scheduler.policy`). A request is admitted only when the pool can
    hold its prompt plus a share of its remaining `max_tokens` on top of what running requests
    reserved; when decoding still runs short, the last request in the policy's order is
    retracted and requeued, its computed pages left in the prefix cache. The share starts at
    `reserve_ratio` and falls to `min_reserve_ratio` over `reserve_decay_steps` steps; a
    retraction sets it back (as SGLang's new-token ratio).

    The scheduler talks to the engine through one call, `engine.forward_batch(plan)`: the plan
    (`Batch`) carries the rows of the step and the request-table writes queued since the last
    one; the engine owns every device tensor.
    """

    def __init__(
        self,
        engine: Engine,
        eos_ids: tuple[int, ...] = (),
        sync: RequestSync | None = None,
        overlap: bool | None = None,
        tokenizer_loader: Callable[[], Any] | None = None,
    ) -> None:
        """`tokenizer_loader`: the model's tokenizer, for grammars (called on first need; the
        default loads it from the model's files)."""
        self.engine = engine
        # Overlap scheduling (on by default on CUDA); `overlap=True` forces it anywhere (tests).
        self.overlap = engine.config.overlap if overlap is None else overlap
        self._in_flight: Step | None = None  # overlap: launched last, not yet processed
        self._launched = 0  # steps launched so far; step k is the k-th
        self._completed = 0  # every step up to this one has completed on the device
        # Tensor parallelism: rank 0's requests and aborts replayed on every rank each step.
        self.sync = sync
        self.config: EngineConfig = engine.config
        self.page_size = engine.page_size
        self.max_context = engine.max_context
        self.eos_ids = frozenset(eos_ids or engine.model_config.eos_token_ids)
        self.num_pages = engine.num_pages
        host_pages, disk_pages = engine.tier_pages
        # Same sizes and schedule on every rank: every rank's tier holds the same pages.
        tier = HostTier(self.page_size, host_pages, disk_pages) if host_pages else None
        self.kv = KVManager(
            PageAllocator(engine.num_pages),
            SlotAllocator(self.config.max_running_requests),
            make_prefix_cache(self.config.cache, self.page_size, tier),
            self.page_size,
            debug=self.config.debug_kv,
            tier=tier,
        )
        self._queued: list[Req] = []  # added since the last plan: their prefixes prefetched
        self.reserve_ratio = self.config.reserve_ratio  # the share admission reserves now
        cfg = self.config
        self._min_reserve = min(cfg.min_reserve_ratio, cfg.reserve_ratio)
        self._reserve_decay = (cfg.reserve_ratio - self._min_reserve) / cfg.reserve_decay_steps
        self.policy = SchedulePolicy(
            cfg.schedule_policy,
            cfg.priority_aging_s if cfg.schedule_policy == "priority" else 0.0,
        )
        # The latency target in seconds: None is auto, 0 is off.
        target = cfg.itl_target_ms  # resolved by the engine: "auto" or milliseconds
        self.itl_target_s = None if target == "auto" else float(target or 0.0) / 1e3
        # The largest prefilling step the engine replays as graphs (0: none): larger ones cost
        # the step-time model's `eager` term more.
        self.graph_tokens = engine.graph_tokens
        measures = sync is None or sync.rank == 0
        publish = sync.publish_step_times if sync is not None and sync.rank == 0 else None
        self.timer = StepTimer(LinearStepTime(), self.overlap, publish, measures)
        self._busy = False  # the last step() left requests running
        self.last_target_s = 0.0  # the latency target of the last step planned (0: none)
        self.waiting = WaitingQueue(self.policy)
        self.running: list[Req] = []
        # (priority, seconds) of each request admitted for the first time, until taken.
        self.queue_times: deque[tuple[int, float]] = deque(maxlen=QUEUE_TIMES_KEPT)
        self.retractions_by_priority: dict[int, int] = {}
        if not cfg.skip_warmup and engine.num_steps == 0:
            self._warmup()
        vocab = engine.model_config.vocab_size
        self.grammars = Grammars(
            tokenizer_loader or self._model_tokenizer, vocab, cfg.ranks_per_node
        )
        self._refused: list[StepEvent] = []  # finished before running (a grammar that failed)
        # Speculative decoding's drafts per step (None: off).
        self.spec: DraftPlanner | None = None
        if cfg.speculative_algorithm is not None:
            self.spec = DraftPlanner(cfg, self.page_size, self.max_context)
        self._arrivals = 0
        self.stats = {
            "prompt_tokens": 0,
            "computed_prompt_tokens": 0,
            "cached_tokens": 0,
            "generated_tokens": 0,
            "retractions": 0,
        }

    def _model_tokenizer(self) -> Any:
        return load_tokenizer(resolve_source(self.config.model))

    @property
    def step_model(self) -> StepTimeModel:
        """Predicts step times for the prefill budget (tests may put a fixed one here)."""
        return self.timer.model

    @step_model.setter
    def step_model(self, model: StepTimeModel) -> None:
        self.timer.model = model

    def _warmup(self) -> None:
        """The start-up steps of `minisgl.scheduler.warmup` (every eager kernel variant that
        serving reaches), then, with a latency target, the step-time model's calibration
        (`minisgl.scheduler.calibrate`), once per engine, before any request."""
        start = time.perf_counter()
        steps = run_warmup(self.engine)
        logger.info("warm-up: %d steps in %.2f s", steps, time.perf_counter() - start)
        if self.itl_target_s == 0:  # the target is off: the online fit alone serves /metrics
            return
        samples = calibrate(self.engine)
        if self.timer.measures:
            self.timer.record(samples, anchor=True)
        logger.info("step-time model from %d timed steps: %s", len(samples), self._model_text())

    def _model_text(self) -> str:
        coef = self.step_model.coefficients()
        return ", ".join(f"{k} {v * 1e3:.4g} ms" for k, v in coef.items())

    def apply_step_times(self, samples: list[Sample], anchor: bool) -> None:
        """Rank 0's measured step times (tensor parallelism: every other rank's model
        follows rank 0's)."""
        self.timer.apply(samples, anchor)

    # ---- requests in and out -------------------------------------------------------------

    def check_request(self, prompt_len: int, params: SamplingParams) -> None:
        """Raise InvalidRequestError if a request of this shape can never be served."""
        resolve_max_tokens(
            prompt_len, params.max_tokens, self.max_context, self.num_pages * self.page_size
        )
        self.policy.check(params.priority)

    def check_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar now (blocks; cached): GrammarError (an
        InvalidRequestError) if it is bad. For callers with no front end that checked it."""
        if params.constraint is not None:
            self.grammars.compiler.compile(params.constraint)

    def add_request(self, req: Req) -> None:
        self.check_request(req.prompt_len, req.params)
        req.params.check_vocab(self.engine.model_config.vocab_size)
        stop = set(req.params.stop_token_ids)
        # Under ignore_eos a grammar's request still ends at EOS, allowed once it is complete.
        if not req.params.ignore_eos or req.params.constraint is not None:
            stop |= self.eos_ids
        req.stop_ids = frozenset(stop)
        req.arrival = self._arrivals
        self._arrivals += 1
        if req.arrival_time is None:  # other ranks than 0 are given rank 0's
            req.arrival_time = time.monotonic()
        self.stats["prompt_tokens"] += req.prompt_len
        self.waiting.push(req)
        self._queued.append(req)
        self.grammars.add(req)
        if self.sync is not None:
            self.sync.publish_add(req)

    def abort(self, rid: str) -> Req | None:
        """Finish request `rid` with reason abort and free what it holds."""
        if self.sync is not None:
            self.sync.publish_abort(rid)
        for req in list(self.waiting) + self.running:
            if req.rid == rid:
                self._finish(req, FinishReason.ABORT)
                self._reclaim()
                return req
        return None

    def flush_cache(self) -> int:
        """Drop every prefix-cache entry no running request holds; returns the pages freed."""
        self._reclaim()
        return self.kv.flush()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._in_flight)

    # ---- one step --------------------------------------------------------------------------

    def step(self) -> list[StepEvent]:
        """Run one step: `run_overlapped` when overlap scheduling is on, else `run_normal`."""
        self.timer.iteration(self._busy)
        if self.sync is None or self.sync.rank == 0:
            for rid in self.grammars.poll():
                self.grammar_ready(rid)
        if self.sync is not None:  # take in what rank 0 received (tensor parallelism)
            self.sync.exchange(self)
        refused, self._refused = self._refused, []
        events = self.run_overlapped() if self.overlap else self.run_normal()
        if not (self.running or self._in_flight or refused):
            self.grammars.wait(GRAMMAR_POLL_S)  # only requests whose grammar still compiles
        # The next iteration follows at once with a step to run (else its periods start anew).
        self._busy = bool(self.running or self._in_flight)
        return refused + events

    def grammar_ready(self, rid: str) -> None:
        """Request `rid`'s grammar has compiled (or failed to): it may be admitted now."""
        if self.sync is not None:
            self.sync.publish_grammar_ready(rid)
        self.grammars.mark_ready(rid)
        req = next((r for r in self.waiting if r.rid == rid), None)
        error = None if req is None else self.grammars.failure(req)
        if req is not None and error is not None:
            req.error = error
            self._finish(req, FinishReason.ABORT)
            self._refused.append(StepEvent(req, [], True))

    def run_normal(self) -> list[StepEvent]:
        """Schedule, run and process one batch; the step's tokens come back in this call."""
        planned = self.schedule()
        return [] if planned is None else self.process(self._launch(*planned))

    def run_overlapped(self) -> list[StepEvent]:
        """Launch the next batch, then process the previous one while the device runs it.

        The new batch is scheduled before the previous step's tokens are known: its input ids
        come from the device token table, and a request that the previous step finishes (EOS)
        has at most one extra step in flight, whose token is dropped. What requests released
        here comes back once the launched step has completed (`_reclaim`).

        A step with constrained rows needs the previous step's tokens for its token mask: the
        engine launches the model, then calls back, and the previous step is processed (and
        the mask filled) while the device runs the new step's forward.
        """
        last = self._in_flight
        # Drafts need every token on the host: finish the step in flight, then verify.
        if (
            last is not None
            and self.spec is not None
            and self.spec.expects_drafts(self._decoding())
        ):
            self._in_flight = None
            return self.process(last) + self.run_normal()
        planned = self.schedule()
        prev, events = self._in_flight, None

        def process_prev() -> None:
            nonlocal events
            if prev is not None and events is None:
                events = self.process(prev)

        launched = None if planned is None else self._launch(*planned, before_mask=process_prev)
        self._in_flight = launched
        process_prev()
        return events or []

    def _launch(
        self, reqs: list[Req], batch: Batch, before_mask: Callable[[], None] | None = None
    ) -> Step:
        self._launched += 1
        self.kv.launched(self._launched, reqs)
        shape = StepShape.of(batch, self.graph_tokens)
        self.timer.launched(shape)
        mask = None
        if self.grammars.constrained(reqs):
            sampling = [r for r, s in zip(reqs, batch.sample) if s]
            # A verify step's mask has a row per scored position (the grammar is advanced
            # through the drafts); `batch.draft_lens` are the host drafts' lengths.
            drafts = None
            if batch.speculative:
                assert self.spec is not None
                lens = [d for d, s in zip(batch.draft_lens, batch.sample) if s]
                drafts = self.spec.host_drafts(sampling, lens)

            if before_mask is None:  # its tokens are known: fill it while the model runs
                ready = self.grammars.mask(sampling, drafts)

            def mask() -> TokenMask:
                if before_mask is None:
                    return ready
                before_mask()
                return self.grammars.mask(sampling, drafts)

        return Step(self._launched, reqs, batch, self.engine.forward_batch(batch, mask), shape)

    def _reclaim(self, block: bool = False) -> None:
        """Give back what released requests held once the steps that may use it completed;
        with `block`, wait for the step in flight first."""
        if self._in_flight is None:
            self._completed = self._launched
        else:
            step = self._in_flight
            if block:
                step.out.wait()
            if step.out.done():
                self._completed = step.number
        self.kv.reclaim(self._completed)

    def schedule(self) -> tuple[list[Req], Batch] | None:
        """The next step's requests and plan (None: nothing to run)."""
        self._reclaim()
        # In the plan, not at arrival: every rank then prefetches at the same point.
        self.kv.prefetch([r for r in self._queued if r.status == ReqStatus.WAITING])
        self._queued = []
        if self.policy.by_priority:
            self._preempt_for_waiting()
        decode = self._make_room_for_decode(self._decoding())
        room = self.kv.available_pages - self._pages_needed(decode)
        drafts = [0] * len(decode)
        if self.spec is not None:
            in_flight, valid = self._in_flight is not None, self.grammars.valid_drafts
            drafts, room = self.spec.plan(decode, room, in_flight, valid, self.kv.write_tokens)
        prefill = self._prefill_chunks(room, self._budget(decode))
        stuck = [r for r in self.running if self._needs_step(r)]
        if not decode and not prefill and stuck:
            # Partial prefills stuck without pages: free the last one's and try again.
            self._retract(max(stuck, key=self.policy.key))
            return self.schedule()
        reqs = decode + [r for r, _ in prefill]
        if not reqs:
            return None
        draft_lens = drafts + [0] * len(prefill) if any(drafts) else []
        extend = [1 + d for d in drafts] + [n for _, n in prefill]
        sample = [True] * len(decode) + [r.num_computed + n == r.seq_len for r, n in prefill]
        for r, e in zip(reqs, extend):
            p = r.num_computed
            self.stats["computed_prompt_tokens"] += max(0, min(p + e, r.prompt_len) - p)
        self.reserve_ratio = max(self._min_reserve, self.reserve_ratio - self._reserve_decay)

        def writes() -> dict[str, Any]:
            pages, tokens, freed, copies = self.kv.take_writes()
            return dict(
                page_writes=pages,
                token_writes=tokens,
                freed_pages=freed,
                page_copies=copies,
                draft_lens=draft_lens,
            )

        return reqs, plan_step(reqs, extend, sample, self.kv.grow, writes)

    def _can_sample_more(self, r: Req) -> bool:
        """False once the launched steps have sampled every token `r` may get."""
        return r.num_sampled < r.params.max_tokens and r.seq_len < self.max_context

    def _ready_to_decode(self, r: Req) -> bool:
        return r.num_computed == r.seq_len - 1 and self._can_sample_more(r)

    def _decoding(self) -> list[Req]:
        """The running requests ready to decode."""
        return [r for r in self.running if self._ready_to_decode(r)]

    def _needs_step(self, r: Req) -> bool:
        """Prefilling or decoding; not a request only waiting for its last token to land."""
        return r.num_computed < r.seq_len - 1 or self._ready_to_decode(r)

    def _pages_needed(self, reqs: list[Req]) -> int:
        """New pages the decode step of `reqs` needs."""
        return sum(max(0, pages_for(r.seq_len, self.page_size) - len(r.pages)) for r in reqs)

    def _make_room_for_decode(self, decode: list[Req]) -> list[Req]:
        """Retract the last requests in the policy's order until every decoding request has
        room for its token (first waiting for the step in flight, when released pages only
        wait for it)."""
        while decode and self._pages_needed(decode) > self.kv.available_pages:
            if self.kv.deferred_pages and self._completed < self._launched:
                self._reclaim(block=True)
                continue
            victim = max((r for r in self.running if self._needs_step(r)), key=self.policy.key)
            self._retract(victim)
            decode = [r for r in decode if r is not victim]
        return decode

    def _preempt_for_waiting(self) -> None:
        """Priority policy: while the first waiting request that could start cannot be
        admitted for lack of KV or a slot, retract the least urgent running request that is
        less urgent than it. (Keys never change, so two requests never take turns.)"""
        head = next((r for r in self.waiting if self._admissible(r)), None)
        if head is None:
            return
        key = self.policy.key(head)
        while True:
            reserved = sum(self._reserved(r) for r in self.running)
            if self.kv.slots.num_free and self._can_admit(head, reserved):
                return
            victims = [r for r in self.running if self._needs_step(r) and self.policy.key(r) > key]
            freeable = self.kv.available_pages + sum(len(r.pages) for r in victims)
            if not victims or pages_for(head.seq_len + 1, self.page_size) > freeable:
                return  # nobody to retract, or retracting them all would not make room
            if self.kv.has_deferred and self._completed < self._launched:
                self._reclaim(block=True)
                continue
            # Not a pool that ran short: the reservation share stays where it is (raising it
            # would raise every running request's reservation and call for more victims).
            self._retract(max(victims, key=self.policy.key), ran_short=False)

    def prefill_budget(self, num_decode: int) -> int:
        """Prompt tokens a step with `num_decode` decoding requests may compute (the token
        limit; the latency target may allow fewer)."""
        return token_budget(self.config.max_prefill_tokens, num_decode)

    def _budget(self, decode: list[Req]) -> PrefillBudget:
        kv = sum(r.seq_len for r in decode)
        decodes = StepShape(len(decode), 0, kv, False, self.graph_tokens)
        budget = PrefillBudget.plan(
            self.config.max_prefill_tokens,
            self.page_size,
            decodes,
            self.step_model,
            self.itl_target_s,
        )
        self.last_target_s = 0.0 if budget.limit is None else budget.limit.target_s
        return budget

    def _admissible(self, req: Req) -> bool:
        """Whether a waiting request could start now if there were room."""
        # A request retracted with a token still in flight: its ids are not all known yet.
        return self.grammars.is_ready(req) and len(req.output_ids) == req.num_sampled

    def _prefill_chunks(self, room: int, budget: PrefillBudget) -> list[tuple[Req, int]]:
        chunks: list[tuple[Req, int]] = []
        for r in self.running:  # continue partial prefills first
            if r.num_computed < r.seq_len - 1 and not budget.exhausted:
                n = budget.size(r.num_computed, r.seq_len - r.num_computed)
                need = pages_for(r.num_computed + n, self.page_size) - len(r.pages)
                if n > 0 and need <= room:
                    chunks.append((r, n))
                    budget.take(r.num_computed, n)
                    room -= need
        reserved = sum(self._reserved(r) for r in self.running) if self.waiting else 0
        for req in self.waiting:
            if budget.exhausted or self.kv.slots.num_free == 0:
                break
            if not self.grammars.is_ready(req):
                continue  # its grammar still compiles: the requests behind it may go first
            if not self._admissible(req) or not self._can_admit(req, reserved):
                break
            self.waiting.remove(req)
            self._admit(req)
            reserved += self._reserved(req)
            n = budget.size(req.num_computed, req.seq_len - req.num_computed)
            if n > 0:
                chunks.append((req, n))
                budget.take(req.num_computed, n)
        return chunks

    def _reserved(self, req: Req) -> int:
        """Pages `req` may still need beyond what it holds (prompt + a share of its output)."""
        future = int(req.remaining_tokens * self.reserve_ratio + 0.999)
        return max(0, pages_for(req.seq_len + future, self.page_size) - len(req.pages))

    def _can_admit(self, req: Req, reserved: int) -> bool:
        """`reserved`: what the running requests reserved (`_reserved` summed)."""
        # A question only: admission may say no, and a match would split cache entries and
        # keep a blocked request's prefix fresh in the LRU order.
        matched = self.kv.cache.peek(req.all_ids()[: req.seq_len - 1]) // self.page_size
        # Matched pages stop being evictable once locked, so they don't add room.
        room = self.kv.available_pages - min(matched, self.kv.cache.evictable_pages)
        need = self._reserved(req) - matched
        if not self.running:  # alone it must at least fit its prompt, or nothing ever runs
            need = pages_for(req.seq_len + 1, self.page_size) - matched
        return reserved + need <= room

    def _admit(self, req: Req) -> None:
        self.kv.attach(req)
        self.grammars.admit(req)
        if req.num_retractions == 0:
            req.cached_tokens = req.num_computed
            self.stats["cached_tokens"] += req.num_computed
            assert req.arrival_time is not None
            self.queue_times.append((req.params.priority, time.monotonic() - req.arrival_time))
        req.status = ReqStatus.RUNNING
        self.running.append(req)

    def _retract(self, req: Req, ran_short: bool = True) -> None:
        logger.info("retracting %s to free KV pages", req.rid)
        self.stats["retractions"] += 1
        p, counts = req.params.priority, self.retractions_by_priority
        if p in counts or len(counts) < PRIORITIES_COUNTED:
            counts[p] = counts.get(p, 0) + 1
        if ran_short:  # decoding ran out of pages: reserve more again
            self.reserve_ratio = self.config.reserve_ratio
        self.running.remove(req)
        self.kv.release(req, self._launched)
        req.num_retractions += 1
        req.status = ReqStatus.WAITING
        self.waiting.push(req)

    # ---- results ---------------------------------------------------------------------------

    def process(self, step: Step) -> list[StepEvent]:
        """Turn a step's sampled tokens into request progress (waits for them to land).

        With overlap, requests of `batch` may have finished, been aborted or been retracted
        since it was launched: a finished one drops its token; a retracted one keeps it (it
        was sampled from a complete context, and `num_sampled` already counts it).
        """
        reqs, batch, out = step.reqs, step.batch, step.out
        out.wait()
        self.timer.completed(step.shape)
        self._completed = max(self._completed, step.number)
        counts = out.counts or [1] * len(out.sample_rows)
        drafts = batch.draft_lens or [0] * batch.size
        # The step's KV is in the pool now: a request that finishes below caches all of it
        # (a verify row's up to its last token: its accepted drafts count once appended).
        live = [r.seq is seq for r, seq in zip(reqs, batch.seqs)]  # not released since
        for i, (r, is_live, end) in enumerate(zip(reqs, live, batch.seq_lens)):
            if is_live:
                r.num_stored = max(r.num_stored, batch.prefix_lens[i] + 1 if drafts[i] else end)
        tokens = out.tokens_host.tolist()
        events: list[StepEvent] = []
        flat = 0
        for row, count in zip(out.sample_rows, counts):
            req, first = reqs[row], flat
            flat += count
            if req.finished:  # finished or aborted while its step ran: the token is dropped
                continue
            new: list[int] = []
            for k in range(first, first + count):
                self._append_token(req, tokens[k], out, k)
                new.append(tokens[k])
                if req.finished:
                    break
            if drafts[row]:
                assert self.spec is not None
                self.spec.verified(req, batch.prefix_lens[row], drafts[row], count)
                if not req.finished:  # (released with its step: nothing left to roll back)
                    self.kv.shrink(req, req.seq_len, self._launched)  # the rejected drafts' pages
            events.append(StepEvent(req, new, req.finished))
        # After the tokens: a request's next step (in flight) may already count the KV of the
        # token just appended, and the cache needs the ids of every page it takes.
        for r, seq, e in zip(reqs, batch.seqs, batch.extend_lens):
            if e > 1 and r.seq is seq:  # a prefill chunk: share its pages with later requests
                self.kv.cache_prefix(r, self._launched)
        self.kv.reclaim(self._completed)
        return events

    def _append_token(self, req: Req, token: int, out: ForwardOutput, k: int) -> None:
        req.output_ids.append(token)
        self.stats["generated_tokens"] += 1
        if out.logprobs_host is not None:
            req.output_logprobs.append(float(out.logprobs_host[k]))
        if out.top_ids_host is not None and out.top_logprobs_host is not None:
            n = req.params.top_logprobs
            ids, lps = out.top_ids_host[k, :n].tolist(), out.top_logprobs_host[k, :n].tolist()
            req.output_top_logprobs.append(list(zip(ids, lps)))
        # Lengths the host knows: with overlap, `seq_len` already counts tokens in flight.
        if not self.grammars.accept(req, token):  # the mask allowed it: a bug of ours
            logger.error("request %s: its grammar refused token %d", req.rid, token)
            req.error = "internal error: the output left the request's grammar"
            self._finish(req, FinishReason.ABORT)
        elif token in req.stop_ids:
            self._finish(req, FinishReason.STOP)
        elif (
            len(req.output_ids) >= req.params.max_tokens
            or req.prompt_len + len(req.output_ids) >= self.max_context
        ):
            self._finish(req, FinishReason.LENGTH)

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.finish_reason = reason
        self.grammars.drop(req.rid)
        if self.spec is not None:
            self.spec.drop(req.rid)
        if req in self.running:
            self.running.remove(req)
            self.kv.release(req, self._launched)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = ReqStatus.FINISHED

    # ---- accounting ------------------------------------------------------------------------

    def kv_accounting(self) -> dict[str, int]:
        held = sum(self.kv.own_pages(r) for r in self.running)
        return {
            "free": self.kv.allocator.num_free,
            "held_by_requests": held,
            "protected": self.kv.cache.protected_pages,
            "evictable": self.kv.cache.evictable_pages,
            "released": self.kv.deferred_pages,  # waiting for a step in flight to complete
            "total": self.num_pages,
        }

    def check_invariants(self) -> None:
        """Device: free + held + cache + released == total; host and disk: each tier's used
        and free slots are its slots, each once."""
        a = self.kv_accounting()
        total = sum(v for k, v in a.items() if k != "total")
        assert total == a["total"], f"KV pages leaked or double counted: {a}"
        if self.kv.tier is not None:
            self.kv.tier.check()

    def tier_stats(self) -> dict[str, float]:
        """The host tier's pages per tier, hits and bytes moved since start ({}: no tier)."""
        tier, copier = self.kv.tier, self.engine.tier
        if tier is None or copier is None:
            return {}
        hits = {"host_hit_pages": tier.stats.loaded, "disk_hit_pages": tier.stats.fetched}
        return {**tier.accounting(), **hits, **dataclasses.asdict(copier.collect())}
