"""The scheduler process's loop: tokenized requests and aborts in over ZMQ, token outputs out
(the process itself is started by `minisgl.runtime`).

The loop blocks on its inbox while the scheduler has nothing to do, and otherwise drains the
inbox without waiting before every step, so new requests join the next batch.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from minisgl.core import InvalidRequestError, Req
from minisgl.message import (
    AbortReq,
    FlushCacheOut,
    FlushCacheReq,
    SchedulerOut,
    SchedulerStats,
    TokenizedReq,
    TokenOut,
)
from minisgl.message.transport import Receiver, Sender
from minisgl.scheduler.scheduler import Scheduler
from minisgl.spec import SpecStats

logger = logging.getLogger(__name__)


def token_out(req: Req, new_ids: list[int], error: str | None = None) -> TokenOut:
    """What the detokenizer needs to know about `req` after it gained `new_ids`."""
    p, n = req.params, len(new_ids)
    error = error or req.error
    out = TokenOut(
        rid=req.rid,
        new_ids=new_ids,
        finished=req.finished or error is not None,
        finish_reason=req.finish_reason.value if req.finish_reason else None,
        prompt_tokens=req.prompt_len,
        cached_tokens=req.cached_tokens,
        stop=list(p.stop),
        skip_special_tokens=p.skip_special_tokens,
        min_tokens=p.min_tokens,
        include_stop_str_in_output=p.include_stop_str_in_output,
        error=error,
    )
    if n and p.logprobs:
        out.logprobs = req.output_logprobs[-n:]
    if n and p.top_logprobs:
        top = req.output_top_logprobs[-n:]
        out.top_ids = [[t for t, _ in row] for row in top]
        out.top_logprobs = [[lp for _, lp in row] for row in top]
    return out


class SchedulerProcess:
    """Feeds a `Scheduler` from its inbox and publishes one `SchedulerOut` per iteration."""

    def __init__(self, scheduler: Scheduler, inbox: Receiver, outbox: Sender) -> None:
        self.scheduler = scheduler
        self.inbox = inbox
        self.outbox = outbox
        self.pending: list[TokenOut] = []  # outputs produced outside a step (aborts, refusals)
        self.flush_answers: list[FlushCacheOut] = []  # sent after this iteration's stats

    def recv_messages(self, block: bool) -> list[Any]:
        """Every new request and abort; waits for the first one when `block`.

        With tensor parallelism, rank 0 receives here and hands the same list to every rank,
        so all ranks schedule identical inputs.
        """
        first = [self.inbox.recv()] if block else []
        return first + self.inbox.drain()

    def handle(self, msg: Any) -> None:
        if isinstance(msg, TokenizedReq):
            self._add(msg)
        elif isinstance(msg, AbortReq):
            self._abort(msg.rid)
        elif isinstance(msg, FlushCacheReq):
            self._flush_cache(msg.token)
        else:
            raise TypeError(f"scheduler: unexpected message {type(msg).__name__}")

    def _add(self, msg: TokenizedReq) -> None:
        req = Req(rid=msg.rid, prompt_ids=msg.input_ids, params=msg.params, seed=msg.seed)
        try:
            self.scheduler.add_request(req)
        except InvalidRequestError as e:
            # The tokenizer checks the same limits first; this only guards a mismatch.
            self.pending.append(token_out(req, [], error=str(e)))

    def _abort(self, rid: str) -> None:
        req = self.scheduler.abort(rid)
        if req is not None:  # None: it finished already, and that output went out
            self.pending.append(token_out(req, []))

    def _flush_cache(self, token: int) -> None:
        s = self.scheduler
        # Running requests hold cache pages (flushing half of it helps nobody); a step still in
        # flight (overlap) may write pages of requests that just finished: it counts as one.
        in_flight = len(s.running) + len(s.waiting) or int(s.has_work)
        if in_flight:
            logger.warning("flush_cache refused: %d requests are in flight", in_flight)
        else:
            s.flush_cache()
            logger.info("prefix cache flushed")
        self.flush_answers.append(FlushCacheOut(token, in_flight))

    def run_once(self) -> None:
        for msg in self.recv_messages(block=not self.scheduler.has_work):
            self.handle(msg)
        outputs, self.pending = self.pending, []
        if self.scheduler.has_work:
            outputs += [token_out(ev.req, ev.new_tokens) for ev in self.scheduler.step()]
        self.outbox.send(SchedulerOut(outputs, self.stats()))
        # After the stats: when the API server hears that the cache was flushed, its metrics
        # already show it.
        for answer in self.flush_answers:
            self.outbox.send(answer)
        self.flush_answers.clear()

    def run_forever(self) -> None:
        while True:
            self.run_once()

    def stats(self) -> SchedulerStats:
        s = self.scheduler
        kv, st, gs, timed = s.kv_accounting(), s.stats, s.grammars.stats, s.timer.totals
        queue_times = [[float(p), t] for p, t in s.queue_times]
        spec = s.spec.stats if s.spec is not None else SpecStats()
        s.queue_times.clear()
        return SchedulerStats(
            running=len(s.running),
            waiting=len(s.waiting),
            kv_free=kv["free"],
            kv_held=kv["held_by_requests"],
            kv_protected=kv["protected"],
            kv_evictable=kv["evictable"],
            kv_total=kv["total"],
            prompt_tokens=st["prompt_tokens"],
            cached_tokens=st["cached_tokens"],
            generated_tokens=st["generated_tokens"],
            constrained_requests=s.grammars.num_constrained,
            grammar_compiles=gs.compiled,
            grammar_compile_seconds=gs.seconds,
            grammar_cache_hits=gs.hits,
            time=time.time(),
            retractions=st["retractions"],
            spec_verify_rows=spec.verify_rows,
            spec_proposed=spec.proposed,
            spec_accepted=spec.accepted,
            spec_missed_waits=spec.missed,
            retractions_by_priority=[[p, n] for p, n in s.retractions_by_priority.items()],
            queue_times=queue_times,
            steps_timed=timed.steps,
            step_predicted_s=timed.predicted_s,
            step_measured_s=timed.measured_s,
            step_abs_error_s=timed.abs_error_s,
            step_model=s.step_model.coefficients(),
            itl_target_s=s.last_target_s,
            kv_tier=s.tier_stats(),
        )
