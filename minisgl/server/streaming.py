"""What every generating endpoint shares: waiting for output while watching the client,
collecting whole answers, and server-sent events whose end (normal, error or disconnect)
aborts what is still running."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from minisgl.message import GenerateReq, StrOut, TokenLogprob
from minisgl.server.engine_client import ChoiceOutput, EngineClient, RequestStream
from minisgl.server.errors import ApiError, ClientDisconnected, error_body
from minisgl.server.limits import check_prompts, check_seqs

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


# A string as `json.dumps(ensure_ascii=False)` writes it (its C encoder).
json_str: Callable[[str], str] = json.encoder.encode_basestring  # type: ignore[attr-defined]
CHOICE = "\0choice\0"  # where an `Envelope`'s body takes each event's choice


class Envelope:
    """The event of a stream's chunks around their one choice, encoded once per stream: each
    event encodes only its choice (`sse(body)` with `CHOICE` replaced, byte for byte)."""

    def __init__(self, body: dict[str, Any]) -> None:
        self._head, self._tail = sse(body).split(json.dumps(CHOICE).encode())

    def event(self, choice: dict[str, Any] | str) -> bytes:
        """`choice`: a dict, or its JSON text (as `json.dumps` writes it)."""
        text = choice if isinstance(choice, str) else json.dumps(choice, ensure_ascii=False)
        return self._head + text.encode() + self._tail


async def _wait_disconnect(request: Request) -> None:
    # The body is read already, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or `ClientDisconnected` (with `work` cancelled) if the client leaves
    first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise ClientDisconnected()
    return task.result()


Batches = AsyncIterator[list[ChoiceOutput]]


async def answer(
    request: Request,
    client: EngineClient,
    reqs: list[GenerateReq],
    num_choices: int,
    stream: bool,
    events: Callable[[Batches], AsyncIterator[bytes]],
    whole: Callable[[list[ChoiceResult]], dict[str, Any]],
) -> Response:
    """The answer to `reqs` (once they pass the request limits): server-sent `events` of their
    outputs, or the JSON body `whole` makes of every choice's result; their choices are aborted
    if the client leaves first. A stream waits for its first output, so that a refused request
    still gets a 4xx status (an SSE response commits to 200 when it starts)."""
    check_seqs(reqs, client.limits)
    if client.info is not None:
        check_prompts(reqs, client.info)
    outputs = client.submit(reqs)
    try:
        if not stream:
            return JSONResponse(
                whole(await until_disconnect(request, collect(outputs, num_choices)))
            )
        first = await until_disconnect(request, outputs.next_batch())
    except BaseException:
        outputs.close()
        raise
    return EventStreamResponse(events(_batches(first, outputs)), outputs)


async def _batches(first: list[ChoiceOutput], stream: RequestStream) -> Batches:
    yield first
    async for batch in stream:
        yield batch


async def with_errors(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`events`; when the request fails after the stream began, an error event (the error body
    of a non-streaming answer) and `[DONE]` end it instead."""
    try:
        async for event in events:
            yield event
    except ApiError as err:
        yield sse(error_body(err.status, err.message, err.param))
        yield DONE


class EventStreamResponse(StreamingResponse):
    """SSE that aborts its request's unfinished choices however the response ends."""

    def __init__(self, events: AsyncIterator[bytes], stream: RequestStream) -> None:
        super().__init__(
            with_errors(events),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.close()


@dataclass
class ChoiceResult:
    """One choice accumulated from its outputs."""

    parts: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    token_times: list[float] = field(default_factory=list)  # the scheduler's, per token

    def add(self, out: StrOut) -> None:
        self.parts.append(out.text)
        self.ids += out.new_ids
        self.token_times += out.token_times
        self.logprobs += out.logprobs
        self.finish_reason = out.finish_reason
        self.matched_stop = out.matched_stop
        self.prompt_tokens = out.prompt_tokens
        self.cached_tokens = out.cached_tokens
        self.completion_tokens = out.completion_tokens

    @property
    def text(self) -> str:
        return "".join(self.parts)


async def collect(stream: RequestStream, num_choices: int) -> list[ChoiceResult]:
    results = [ChoiceResult() for _ in range(num_choices)]
    try:
        async for batch in stream:
            for co in batch:
                results[co.index].add(co.out)
    finally:
        stream.close()
    return results
