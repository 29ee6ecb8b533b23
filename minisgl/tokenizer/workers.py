"""The loops of the tokenizer and detokenizer worker processes (started by `minisgl.runtime`)."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from minisgl.constrain import GrammarCompiler, GrammarError
from minisgl.core import InvalidRequestError
from minisgl.message import (
    AbortReq,
    DetokOut,
    FlushCacheOut,
    FlushCacheReq,
    GenerateReq,
    RequestError,
    SchedulerOut,
    StrOut,
    TokenizedReq,
    TokenLogprob,
    TokenOut,
    TopLogprob,
)
from minisgl.message.transport import Receiver, Sender
from minisgl.tokenizer.output import OutputDelta, OutputOptions, RequestOutput
from minisgl.tokenizer.tokenize import RequestTokenizer

logger = logging.getLogger(__name__)


# Prompts up to this many characters are tokenized at once in the worker's loop (well under a
# millisecond); longer ones in a few threads (HF fast tokenizers release the GIL), so that a
# long prompt never holds up the short ones behind it.
INLINE_CHARS = 4096
TOKENIZE_THREADS = 4

Outcome = list[TokenizedReq] | RequestError


@dataclass
class _Pending:
    """A request whose tokenization runs in a thread; aborts of its choices wait here, as its
    choices have not reached the scheduler yet."""

    req: GenerateReq
    aborted: set[str] = field(default_factory=set)


class TokenizerWorker:
    """Requests from the API become tokenized requests for the scheduler. An abort never
    overtakes its request: it follows it down the same pipe, or, while the request still
    tokenizes, keeps the aborted choices from ever being sent.

    A request with a grammar has it checked first by `grammars` (on its own threads, without
    the vocabulary: `GrammarCompiler.check`), and is refused here when the grammar is bad: it
    never reaches the scheduler, and no other request waits for the check. Only the scheduler
    compiles the grammar (its text is what travels).
    """

    def __init__(
        self,
        tokenizer: RequestTokenizer,
        inbox: Receiver,
        scheduler: Sender,
        api: Sender,
        threads: int = TOKENIZE_THREADS,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.inbox = inbox
        self.scheduler = scheduler
        self.api = api
        self.grammars = grammars or GrammarCompiler(
            lambda: tokenizer.tokenizer, tokenizer.info.vocab_size
        )
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        self._pending: dict[str, _Pending] = {}  # rid -> its request, while it tokenizes
        self._done: queue.SimpleQueue[tuple[_Pending, Outcome]] = queue.SimpleQueue()
        # A thread that finishes writes a byte here, so the loop wakes from waiting on the inbox.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def handle(self, msg: Any) -> None:
        if isinstance(msg, AbortReq):
            self._abort(msg)
        elif isinstance(msg, FlushCacheReq):
            self.scheduler.send(msg)
        elif isinstance(msg, GenerateReq):
            self._generate(msg)
        else:
            raise TypeError(f"tokenizer: unexpected message {type(msg).__name__}")

    def _abort(self, msg: AbortReq) -> None:
        pending = self._pending.get(msg.rid)
        if pending is not None:
            pending.aborted.add(msg.rid)
        else:
            self.scheduler.send(msg)

    def _generate(self, req: GenerateReq) -> None:
        logger.debug("request %s: %d prompt characters", req.rids[0], req.prompt_chars)
        constraint = req.params.constraint
        if constraint is None and req.prompt_chars <= INLINE_CHARS:
            self._send(self._tokenize(req), aborted=set())
            return
        pending = _Pending(req)
        for rid in req.rids:
            self._pending[rid] = pending
        if constraint is None:
            self._pool.submit(self._tokenize_in_thread, pending)
        else:
            job = self.grammars.submit_check(constraint)
            job.add_done_callback(lambda job: self._grammar_checked(pending, job))

    def _grammar_checked(self, pending: _Pending, job: Future[Any]) -> None:
        """(On a compile thread.) Refuse the request, or tokenize it next."""
        try:
            job.result()
        except Exception as e:
            self._finish(pending, self._refusal(pending.req, e, "the grammar check"))
            return
        self._pool.submit(self._tokenize_in_thread, pending)

    def _tokenize(self, req: GenerateReq) -> Outcome:
        try:
            return self.tokenizer.tokenize(req)
        except Exception as e:
            return self._refusal(req, e, "the tokenizer")

    @staticmethod
    def _refusal(req: GenerateReq, e: Exception, what: str) -> RequestError:
        """The answer to a request that `what` failed on: 400 naming the field to change for the
        user's mistake; 500 for a bug of ours, which must neither leave the request hanging nor
        take the worker down."""
        if isinstance(e, GrammarError):
            param = req.grammar_field or e.kind
            return RequestError(req.rids, f"{param}: {e.reason}", param, 400)
        if isinstance(e, InvalidRequestError):
            return RequestError(req.rids, str(e), str(e).split(":", 1)[0], 400)
        logger.error("%s failed on request %s", what, req.rids[0], exc_info=e)
        return RequestError(req.rids, f"{what} failed: {e}", None, 500)

    def _tokenize_in_thread(self, pending: _Pending) -> None:
        self._finish(pending, self._tokenize(pending.req))

    def _finish(self, pending: _Pending, outcome: Outcome) -> None:
        """(On any thread.) Hand the outcome to the loop, and wake it."""
        self._done.put((pending, outcome))
        # A full pipe holds wake-ups the loop has yet to read: one more adds nothing.
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"\0")

    def _send(self, outcome: Outcome, aborted: set[str]) -> None:
        if isinstance(outcome, RequestError):
            self.api.send(outcome)
            return
        for r in outcome:
            if r.rid not in aborted:
                self.scheduler.send(r)

    def poll(self) -> None:
        """Handle every message that has arrived and every tokenization that has finished."""
        for msg in self.inbox.drain():
            self.handle(msg)
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_r, 65536)
        while not self._done.empty():
            pending, outcome = self._done.get_nowait()
            for rid in pending.req.rids:
                del self._pending[rid]
            self._send(outcome, pending.aborted)

    def step(self) -> None:
        """Wait for a message or a finished tokenization, then handle all there are."""
        self.inbox.wait(also=self._wake_r)
        self.poll()

    def run_forever(self) -> None:
        while True:
            self.step()


# ---- the detokenizer's bookkeeping ---------------------------------------------------------------
# The detokenizer's bookkeeping: scheduler token outputs in, text outputs for the API out.
class Detokenizer:
    """Keeps one `RequestOutput` (the output pipeline) per live request id.

    `process` returns the text output for the API (None when there is nothing to tell) and
    whether the scheduler must be told to abort the request (a stop string matched).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestOutput] = {}
        self._token_text: dict[int, str] = {}

    def process(self, out: TokenOut) -> tuple[StrOut | None, bool]:
        state = self.states.get(out.rid)
        if state is None:
            options = OutputOptions(
                tuple(out.stop),
                out.skip_special_tokens,
                out.min_tokens,
                out.include_stop_str_in_output,
            )
            state = self.states[out.rid] = RequestOutput(self.tokenizer, options)
        if out.finished:  # the scheduler's last word on it (the pipeline may have ended sooner)
            del self.states[out.rid]
        delta = state.add(
            out.new_ids,
            out.finished,
            out.finish_reason,
            out.logprobs,
            out.top_ids,
            out.top_logprobs,
        )
        if delta is None:  # the answer already ended at its stop string
            return None, False
        return self._str_out(out, delta), delta.abort

    def _str_out(self, out: TokenOut, delta: OutputDelta) -> StrOut:
        return StrOut(
            rid=out.rid,
            text=delta.text,
            new_ids=delta.token_ids,
            finished=delta.finished,
            finish_reason=delta.finish_reason,
            prompt_tokens=out.prompt_tokens,
            cached_tokens=out.cached_tokens,
            completion_tokens=delta.completion_tokens,
            logprobs=self._logprobs(delta),
            error=out.error,
            matched_stop=delta.matched_stop,
        )

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def _logprobs(self, delta: OutputDelta) -> list[TokenLogprob]:
        if not delta.logprobs:
            return []
        ids = delta.token_ids
        tops = delta.top_ids or [[] for _ in ids]
        top_lps = delta.top_logprobs or [[] for _ in ids]
        return [
            TokenLogprob(
                self.token_text(tid),
                tid,
                lp,
                [TopLogprob(self.token_text(t), v) for t, v in zip(tids, lps, strict=True)],
            )
            for tid, lp, tids, lps in zip(ids, delta.logprobs, tops, top_lps, strict=True)
        ]


class DetokenizerWorker:
    def __init__(
        self, detokenizer: Detokenizer, inbox: Receiver, scheduler: Sender, api: Sender
    ) -> None:
        self.detokenizer = detokenizer
        self.inbox = inbox
        self.scheduler = scheduler
        self.api = api

    def handle(self, msg: SchedulerOut | FlushCacheOut) -> None:
        if isinstance(msg, FlushCacheOut):  # for the API server, in order with the outputs
            self.api.send(msg)
            return
        outputs: list[StrOut] = []
        for out in msg.outputs:
            text_out, abort = self.detokenizer.process(out)
            if abort:  # stop computing an answer that already ended at a stop string
                self.scheduler.send(AbortReq(out.rid))
            if text_out is not None:
                outputs.append(text_out)
        self.api.send(DetokOut(outputs, msg.stats))

    def run_forever(self) -> None:
        while True:
            self.handle(self.inbox.recv())
