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
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from minisgl.message import GenerateReq, StrOut, TokenLogprob
from minisgl.server.engine_client import (
    ChoiceOutput,
    EngineClient,
    EngineUnavailable,
    RequestRejected,
    RequestStream,
    ServerBusy,
)
from minisgl.server.errors import ApiError, ClientDisconnected, error_body
from minisgl.server.limits import check_prompts, check_seqs

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
# What a 503 for a full queue asks the client to wait: about one prefill of a full batch.
RETRY_AFTER_S = 1


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


def api_error(e: Exception) -> ApiError:
    """The HTTP answer for an exception a request stream raised."""
    if isinstance(e, RequestRejected):
        return ApiError(e.status, str(e), e.param)
    if isinstance(e, EngineUnavailable):
        return ApiError(503, f"the engine is unavailable: {e}")
    raise e


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


def submit(client: EngineClient, reqs: list[GenerateReq]) -> RequestStream:
    """Send `reqs` once they pass the request limits."""
    check_seqs(reqs, client.limits)
    if client.info is not None:
        check_prompts(reqs, client.info)
    try:
        return client.submit(reqs)
    except EngineUnavailable as e:
        raise api_error(e) from e
    except ServerBusy as e:
        raise ApiError(503, str(e), headers={"Retry-After": str(RETRY_AFTER_S)}) from e


async def first_batch(request: Request, stream: RequestStream) -> list[ChoiceOutput]:
    """Wait for a stream's first output so that a refused request still gets a 4xx status
    (an SSE response commits to 200 when it starts). Closes the stream if that fails."""
    try:
        return await until_disconnect(request, stream.next_batch())
    except (RequestRejected, EngineUnavailable) as e:
        stream.close()
        raise api_error(e) from e
    except BaseException:
        stream.close()
        raise


async def with_errors(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`events`; when the request fails after the stream began, an error event (the error body
    of a non-streaming answer) and `[DONE]` end it instead."""
    try:
        async for event in events:
            yield event
    except (RequestRejected, EngineUnavailable) as e:
        err = api_error(e)
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
    async for batch in stream:
        for co in batch:
            results[co.index].add(co.out)
    return results


async def run_to_completion(
    request: Request, client: EngineClient, reqs: list[GenerateReq], num_choices: int
) -> list[ChoiceResult]:
    """Every choice's whole answer (a non-streaming request); aborted if the client leaves."""
    stream = submit(client, reqs)
    try:
        return await until_disconnect(request, collect(stream, num_choices))
    except (RequestRejected, EngineUnavailable) as e:
        raise api_error(e) from e
    finally:
        stream.close()
