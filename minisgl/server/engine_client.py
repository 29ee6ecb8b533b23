"""The API server's side of the pipes: submit requests, receive their text, abort them.

One receive task reads every output of the detokenizer (and refusals from the tokenizer) and
routes each to the `RequestStream` of the API request it belongs to.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import zmq
import zmq.asyncio

from minisgl.message import (
    AbortReq,
    DetokOut,
    EngineInfo,
    FlushCacheOut,
    FlushCacheReq,
    GenerateReq,
    RequestError,
    SchedulerStats,
    StrOut,
    WorkerDied,
)
from minisgl.message.transport import MAX_API_SERVERS, AsyncReceiver, IpcPaths, Sender, own_rid
from minisgl.server.errors import ApiError, error_param
from minisgl.server.limits import Limits
from minisgl.server.metrics import Metrics

logger = logging.getLogger(__name__)

# What a 503 for a full queue asks the client to wait: about one prefill of a full batch.
RETRY_AFTER_S = 1


class RequestRejected(ApiError):
    """The tokenizer or scheduler refused a request (its message names the field)."""

    def __init__(self, message: str, param: str | None, status: int) -> None:
        super().__init__(status, message, param)


class EngineUnavailable(ApiError):
    """A worker process died or the server is shutting down: no answer will come."""

    def __init__(self, reason: str) -> None:
        super().__init__(503, f"the engine is unavailable: {reason}")
        self.reason = reason


class ServerBusy(ApiError):
    """Too many sequences wait for their first token; the request was not sent."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, headers={"Retry-After": str(RETRY_AFTER_S)})


@dataclass
class _Choice:
    index: int
    started: float  # perf_counter() when submitted
    priority: int = 0
    first_token: bool = False  # seen yet
    last_token_time: float = 0.0  # the scheduler's time of its latest token


@dataclass
class ChoiceOutput:
    """Everything one choice produced since the last batch (consecutive outputs merged)."""

    index: int
    out: StrOut


@dataclass(eq=False)  # identity semantics: streams are kept in sets and dict values
class RequestStream:
    """Outputs of every choice of one API request, in arrival order."""

    client: EngineClient
    choices: dict[str, _Choice]
    _items: list[StrOut | Exception] = field(default_factory=list)
    _wake: asyncio.Future[None] | None = None  # what `next_batch` waits on

    @property
    def finished(self) -> bool:
        """No choice runs and nothing is left to take (a refusal that ended the last choice
        before anyone waited is still raised by `next_batch`)."""
        return not self.choices and not self._items

    def put(self, item: StrOut | Exception) -> None:
        self._items.append(item)
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def next_batch(self) -> list[ChoiceOutput]:
        """Wait for output, then take all that has arrived (one event for all of it: the
        stream catches up at once after a slow write); raises `RequestRejected` or
        `EngineUnavailable`. Call only while not `finished`."""
        while not self._items:
            self._wake = asyncio.get_running_loop().create_future()
            await self._wake
        items, self._items = self._items, []
        batch: list[ChoiceOutput] = []
        for item in items:
            if isinstance(item, Exception):
                raise item
            self._take(item, batch)
        return batch

    def _take(self, out: StrOut, batch: list[ChoiceOutput]) -> None:
        choice = self.choices[out.rid]
        if out.finished:
            del self.choices[out.rid]
        if batch and batch[-1].index == choice.index:
            batch[-1].out = merge(batch[-1].out, out)
        else:
            batch.append(ChoiceOutput(choice.index, out))

    async def __aiter__(self) -> AsyncIterator[list[ChoiceOutput]]:
        while not self.finished:
            yield await self.next_batch()

    def close(self) -> None:
        """Abort every choice still running (the client went away or an error ended it)."""
        for rid in list(self.choices):
            self.client.abort(rid)
        self.choices.clear()


def merge(a: StrOut, b: StrOut) -> StrOut:
    """`a` followed by `b` of the same request as one output."""
    return replace(
        b,
        text=a.text + b.text,
        new_ids=a.new_ids + b.new_ids,
        logprobs=a.logprobs + b.logprobs,
        token_times=a.token_times + b.token_times,
    )


class EngineClient:
    """`info` and `limits` say what the engine accepts (the endpoints check requests against
    them before they submit); `submit` itself keeps the server-wide queue within its cap.

    `index`: this API server process's among `ipc.num_apis`; `queued`: the count of sequences
    queued server-wide (a `multiprocessing.Value` the API processes share; None: this one's)."""

    def __init__(
        self,
        ipc: IpcPaths,
        metrics: Metrics,
        info: EngineInfo | None = None,
        limits: Limits | None = None,
        index: int = 0,
        queued: Any = None,
    ) -> None:
        self.metrics = metrics
        self.info = info
        self.limits = limits or Limits()
        self.index = index
        self._tag = ipc.num_apis > 1  # the workers answer by the process named in each rid
        # Choices without output yet: waiting to be tokenized, admitted or prefilled.
        self._waiting: set[str] = set()
        self._queued = queued if queued is not None else mp.get_context("spawn").Value("i", 0)
        self._actx = zmq.asyncio.Context()
        self._ctx = zmq.Context()
        self._receiver = AsyncReceiver(self._actx, ipc.api_at(index))
        self._tokenizer = Sender(self._ctx, ipc.tokenizer)
        self._streams: dict[str, RequestStream] = {}
        self._task: asyncio.Task[None] | None = None
        self.failure: str | None = None  # why no request can be served any more
        self.stats: SchedulerStats | None = None
        self._flushes: dict[int, asyncio.Future[int]] = {}  # token -> requests in flight
        self._next_flush = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._receive_loop())
        self._task.add_done_callback(self._receive_loop_ended)

    def _receive_loop_ended(self, task: asyncio.Task[None]) -> None:
        # Without the loop no output is routed: end every request rather than let them hang.
        if not task.cancelled() and task.exception() is not None:
            logger.error("the API server's receive loop crashed", exc_info=task.exception())
            self.fail_all(f"internal error: {task.exception()!r}")

    async def stop(self) -> None:
        self.fail_all("the server is shutting down")
        if self._task is not None:
            self._task.cancel()
        self._receiver.close()
        self._tokenizer.close()

    @property
    def num_live_requests(self) -> int:
        return len(self._streams)

    @property
    def num_queued_seqs(self) -> int:
        """Server-wide."""
        return int(self._queued.value)

    def _unqueue(self, rids: set[str]) -> None:
        self._waiting -= rids
        with self._queued.get_lock():
            self._queued.value -= len(rids)

    def submit(self, reqs: list[GenerateReq]) -> RequestStream:
        """Send the prompts of one API request; choices are numbered in order over all rids
        (which name this process when there are several). Raises `ServerBusy` (nothing sent)
        when its choices would overfill the queue."""
        if self.failure is not None:
            raise EngineUnavailable(self.failure)
        now = time.perf_counter()
        if self._tag:
            for r in reqs:
                r.rids = [own_rid(rid, self.index) for rid in r.rids]
        rids = [rid for r in reqs for rid in r.rids]
        with self._queued.get_lock():
            queued = self._queued.value
            if queued + len(rids) > self.limits.max_queued_seqs:
                raise ServerBusy(
                    f"{queued} sequences wait for their first token and this request adds "
                    f"{len(rids)}; the server queues at most {self.limits.max_queued_seqs} "
                    "(--max-queued-seqs): retry later"
                )
            self._queued.value = queued + len(rids)
        self._waiting.update(rids)
        priorities = [r.params.priority for r in reqs for _ in r.rids]
        choices = {rid: _Choice(i, now, p) for i, (rid, p) in enumerate(zip(rids, priorities))}
        stream = RequestStream(self, choices)
        for rid in rids:
            self._streams[rid] = stream
        for r in reqs:
            self._tokenizer.send(r)
        return stream

    def abort(self, rid: str) -> None:
        if rid in self._waiting:
            self._unqueue({rid})
        if self._streams.pop(rid, None) is None:
            return  # finished, refused or failed already
        self.metrics.requests.labels("abort").inc()
        if self.failure is None:
            self._tokenizer.send(AbortReq(rid))

    async def flush_cache(self) -> int:
        """Ask the scheduler to drop unused prefix-cache entries; the number of requests in
        flight that kept it from doing so (0: flushed; the stats already show it)."""
        if self.failure is not None:
            raise EngineUnavailable(self.failure)
        self._next_flush += 1
        token = self._next_flush * MAX_API_SERVERS + self.index  # the answer finds its way
        answer = self._flushes[token] = asyncio.get_running_loop().create_future()
        try:
            self._tokenizer.send(FlushCacheReq(token))
            return await answer
        finally:
            self._flushes.pop(token, None)

    def fail_all(self, reason: str) -> None:
        """End every live request with `EngineUnavailable`; later submits fail the same way."""
        if self.failure is None:
            self.failure = reason
        for stream in set(self._streams.values()):
            stream.put(EngineUnavailable(reason))
        self._streams.clear()
        self._unqueue(set(self._waiting))
        for answer in self._flushes.values():
            if not answer.done():
                answer.set_exception(EngineUnavailable(reason))

    async def _receive_loop(self) -> None:
        while True:
            msg = await self._receiver.recv()
            if isinstance(msg, DetokOut):
                self.stats = msg.stats
                self.metrics.set_scheduler_stats(msg.stats)
                gaps: Counter[tuple[float, int]] = Counter()
                for out in msg.outputs:
                    self._deliver(out, msg.stats.time, gaps)
                self.metrics.on_tokens(gaps)
            elif isinstance(msg, FlushCacheOut):
                answer = self._flushes.get(msg.token)
                if answer is not None and not answer.done():
                    answer.set_result(msg.in_flight)
            elif isinstance(msg, RequestError):
                self._unqueue(self._waiting.intersection(msg.rids))
                for rid in msg.rids:
                    self._reject(rid, RequestRejected(msg.message, msg.param, msg.status))
            elif isinstance(msg, WorkerDied):
                logger.error("%s; failing every request", msg.reason)
                self.fail_all(msg.reason)
            else:
                logger.error("API server: unexpected message %s", type(msg).__name__)

    def _deliver(self, out: StrOut, time_s: float, gaps: Counter[tuple[float, int]]) -> None:
        """`time_s`: when the scheduler had the output's tokens (wall clock); `gaps` counts
        the inter-token gaps of the step's outputs by (gap, priority)."""
        if out.rid in self._waiting:
            self._unqueue({out.rid})
        stream = self._streams.get(out.rid)
        if stream is None:  # aborted: its last outputs are still on their way
            return
        if out.error is not None:
            self._reject(out.rid, RequestRejected(out.error, error_param(out.error), 400))
            return
        out.token_times = [time_s] * len(out.new_ids)
        self._record(stream.choices[out.rid], out, time_s, gaps)
        if out.finished:
            del self._streams[out.rid]
        stream.put(out)

    def _reject(self, rid: str, error: RequestRejected) -> None:
        """End choice `rid` (if still live) with `error`."""
        stream = self._streams.pop(rid, None)
        if stream is not None:
            stream.choices.pop(rid, None)
            stream.put(error)

    def _record(
        self, choice: _Choice, out: StrOut, time_s: float, gaps: Counter[tuple[float, int]]
    ) -> None:
        """TTFT is the API server's (submit to first output); inter-token latency the
        scheduler's (its token times: no queueing between the processes in it), counted in
        `gaps` (the requests of one step mostly share theirs: one observation for them all)."""
        now = time.perf_counter()
        if out.new_ids:
            if not choice.first_token:
                self.metrics.on_first_token(now - choice.started, choice.priority)
                choice.first_token = True
            else:
                gap = (time_s - choice.last_token_time) / len(out.new_ids)
                gaps[gap, choice.priority] += len(out.new_ids)
            choice.last_token_time = time_s
        if out.finished:
            self.metrics.on_finished(out, now - choice.started)
