"""`/v1/chat/completions` and `/v1/completions`: OpenAI requests to engine requests, and
engine outputs to OpenAI responses (JSON or server-sent events)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from minisgl.message import ChatMessage, GenerateReq, TokenLogprob
from minisgl.server.engine_client import ChoiceOutput, EngineClient, RequestStream
from minisgl.server.errors import ApiError
from minisgl.server.protocol import ChatCompletionRequest, CompletionRequest
from minisgl.server.sampling import choice_seeds, new_rid, sampling_params
from minisgl.server.streaming import (
    DONE,
    ChoiceResult,
    EventStreamResponse,
    first_batch,
    run_to_completion,
    sse,
    submit,
)

# ---- requests ------------------------------------------------------------------------------


def check_supported(body: ChatCompletionRequest | CompletionRequest) -> None:
    bad = body.unsupported()
    if bad:
        raise ApiError(
            400,
            f"{bad[0]}: not supported by this server yet; remove it (a server that ignored it "
            "would answer in a different shape than you asked for)",
            bad[0],
        )


def check_token_times(body: ChatCompletionRequest | CompletionRequest) -> None:
    include = body.stream_options is not None and body.stream_options.include_usage
    if body.return_token_times and body.stream and not include:
        raise ApiError(
            400,
            "return_token_times: a stream carries the token times in its usage chunk; set "
            "stream_options.include_usage to true",
            "return_token_times",
        )


def chat_request(body: ChatCompletionRequest) -> GenerateReq:
    check_supported(body)
    check_token_times(body)
    top = body.top_logprobs or 0
    if top and not body.logprobs:
        raise ApiError(400, "top_logprobs: requires logprobs to be true", "top_logprobs")
    params, grammar_field = sampling_params(body, body.logprobs, top)
    base = new_rid()
    return GenerateReq(
        rids=[f"{base}-{i}" for i in range(body.n)],
        seeds=choice_seeds(body.seed, body.n),
        params=params,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        messages=[ChatMessage(m.role, m.text) for m in body.messages],
        grammar_field=grammar_field,
    )


def completion_requests(body: CompletionRequest) -> list[GenerateReq]:
    check_supported(body)
    check_token_times(body)
    prompts = body.prompts()
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ApiError(400, "prompt: must not be empty", "prompt")
    k = body.logprobs
    params, grammar_field = sampling_params(body, k is not None, k or 0)
    reqs = []
    for prompt in prompts:
        base = new_rid()
        reqs.append(
            GenerateReq(
                rids=[f"{base}-{i}" for i in range(body.n)],
                seeds=choice_seeds(body.seed, body.n),
                params=params,
                max_tokens=body.max_tokens or 16,  # OpenAI's documented default
                text=prompt if isinstance(prompt, str) else None,
                input_ids=None if isinstance(prompt, str) else prompt,
                grammar_field=grammar_field,
            )
        )
    return reqs


# ---- results -------------------------------------------------------------------------------


def usage(results: list[ChoiceResult], n: int, token_times: bool = False) -> dict[str, Any]:
    """Prompts count once however many choices share them. `token_times`: add, per choice,
    when the scheduler had each output token (the server's own token timestamps)."""
    firsts = results[::n]
    prompt = sum(r.prompt_tokens for r in firsts)
    completion = sum(r.completion_tokens for r in results)
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in firsts)},
    }
    if token_times:
        out["token_times"] = [r.token_times for r in results]
    return out


def _bytes(s: str) -> list[int]:
    return list(s.encode("utf-8"))


def chat_logprobs(lps: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": t.token,
                "logprob": t.logprob,
                "bytes": _bytes(t.token),
                "top_logprobs": [
                    {"token": x.token, "logprob": x.logprob, "bytes": _bytes(x.token)}
                    for x in t.top
                ],
            }
            for t in lps
        ]
    }


def completion_logprobs(lps: list[TokenLogprob], offset: int, top: bool) -> dict[str, Any]:
    offsets = []
    for t in lps:
        offsets.append(offset)
        offset += len(t.token)
    return {
        "tokens": [t.token for t in lps],
        "token_logprobs": [t.logprob for t in lps],
        "top_logprobs": [{x.token: x.logprob for x in t.top} for t in lps] if top else None,
        "text_offset": offsets,
    }


@dataclass(frozen=True)
class ResponseMeta:
    id: str
    created: int
    model: str

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


# ---- endpoints -----------------------------------------------------------------------------


async def _run(
    request: Request,
    client: EngineClient,
    reqs: list[GenerateReq],
    num_choices: int,
    respond: Callable[[list[ChoiceResult]], dict[str, Any]],
) -> Response:
    return JSONResponse(respond(await run_to_completion(request, client, reqs, num_choices)))


async def chat_completions(
    request: Request, body: ChatCompletionRequest, client: EngineClient, model: str
) -> Response:
    req = chat_request(body)
    meta = ResponseMeta(f"chatcmpl-{new_rid()}", int(time.time()), model)
    if body.stream:
        include = body.stream_options is not None and body.stream_options.include_usage
        stream = submit(client, [req])
        first = await first_batch(request, stream)
        events = _chat_events(
            stream, first, meta, body.n, body.logprobs, include, body.return_token_times
        )
        return EventStreamResponse(events, stream)

    def respond(results: list[ChoiceResult]) -> dict[str, Any]:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": r.text},
                "logprobs": chat_logprobs(r.logprobs) if body.logprobs else None,
                "finish_reason": r.finish_reason,
            }
            for i, r in enumerate(results)
        ]
        return {
            **meta.envelope("chat.completion", choices),
            "usage": usage(results, body.n, body.return_token_times),
        }

    return await _run(request, client, [req], body.n, respond)


async def completions(
    request: Request, body: CompletionRequest, client: EngineClient, model: str
) -> Response:
    reqs = completion_requests(body)
    meta = ResponseMeta(f"cmpl-{new_rid()}", int(time.time()), model)
    num_choices = len(reqs) * body.n
    want_lp, top = body.logprobs is not None, bool(body.logprobs)
    if body.stream:
        include = body.stream_options is not None and body.stream_options.include_usage
        stream = submit(client, reqs)
        first = await first_batch(request, stream)
        events = _completion_events(
            stream, first, meta, num_choices, body.n, want_lp, top, include, body.return_token_times
        )
        return EventStreamResponse(events, stream)

    def respond(results: list[ChoiceResult]) -> dict[str, Any]:
        choices = [
            {
                "index": i,
                "text": r.text,
                "logprobs": completion_logprobs(r.logprobs, 0, top) if want_lp else None,
                "finish_reason": r.finish_reason,
            }
            for i, r in enumerate(results)
        ]
        return {
            **meta.envelope("text_completion", choices),
            "usage": usage(results, body.n, body.return_token_times),
        }

    return await _run(request, client, reqs, num_choices, respond)


async def _batches(
    stream: RequestStream, first: list[ChoiceOutput]
) -> AsyncIterator[list[ChoiceOutput]]:
    yield first
    async for batch in stream:
        yield batch


async def _chat_events(
    stream: RequestStream,
    first: list[ChoiceOutput],
    meta: ResponseMeta,
    n: int,
    logprobs: bool,
    include_usage: bool,
    token_times: bool,
) -> AsyncIterator[bytes]:
    def chunk(index: int, delta: dict[str, Any], lps: Any, reason: str | None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": reason}
        body = meta.envelope("chat.completion.chunk", [choice])
        if include_usage:
            body["usage"] = None
        return sse(body)

    results = [ChoiceResult() for _ in range(n)]
    yield b"".join(chunk(i, {"role": "assistant", "content": ""}, None, None) for i in range(n))
    async for batch in _batches(stream, first):
        events = []
        for co in batch:
            out = co.out
            results[co.index].add(out)
            if out.text or out.logprobs:
                lps = chat_logprobs(out.logprobs) if logprobs else None
                events.append(chunk(co.index, {"content": out.text}, lps, None))
            if out.finished:
                events.append(chunk(co.index, {}, None, out.finish_reason))
        yield b"".join(events)
    if include_usage:
        yield sse(
            {**meta.envelope("chat.completion.chunk", []), "usage": usage(results, n, token_times)}
        )
    yield DONE


async def _completion_events(
    stream: RequestStream,
    first: list[ChoiceOutput],
    meta: ResponseMeta,
    num_choices: int,
    n: int,
    want_lp: bool,
    top: bool,
    include_usage: bool,
    token_times: bool,
) -> AsyncIterator[bytes]:
    results = [ChoiceResult() for _ in range(num_choices)]
    offsets = [0] * num_choices
    async for batch in _batches(stream, first):
        events = []
        for co in batch:
            out, i = co.out, co.index
            results[i].add(out)
            lps = completion_logprobs(out.logprobs, offsets[i], top) if want_lp else None
            offsets[i] += sum(len(t.token) for t in out.logprobs)
            choice = {
                "index": i,
                "text": out.text,
                "logprobs": lps,
                "finish_reason": out.finish_reason if out.finished else None,
            }
            body = meta.envelope("text_completion", [choice])
            if include_usage:
                body["usage"] = None
            events.append(sse(body))
        yield b"".join(events)
    if include_usage:
        yield sse({**meta.envelope("text_completion", []), "usage": usage(results, n, token_times)})
    yield DONE
