"""`/v1/chat/completions` and `/v1/completions`: OpenAI requests to engine requests, and
engine outputs to OpenAI responses (JSON or server-sent events)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from minisgl.message import ChatMessage, ChatOptions, GenerateReq, TokenLogprob, ToolCall
from minisgl.server.chat import ChatParsing, parser_factory, tool_plan
from minisgl.server.engine_client import ChoiceOutput, EngineClient, RequestStream
from minisgl.server.errors import ApiError
from minisgl.server.protocol import ChatCompletionRequest, ChatMessageIn, CompletionRequest
from minisgl.server.sampling import (
    GrammarField,
    choice_seeds,
    new_rid,
    request_grammar,
    sampling_params,
)
from minisgl.server.streaming import (
    CHOICE,
    DONE,
    ChoiceResult,
    Envelope,
    EventStreamResponse,
    first_batch,
    json_str,
    run_to_completion,
    sse,
    submit,
)
from minisgl.tokenizer.parsers import THINK_END, ChatDelta, ChatOutputParser
from minisgl.tokenizer.tools import assistant_message, calls_finish

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


def check_stream_fields(body: ChatCompletionRequest | CompletionRequest) -> None:
    if body.stream_options is not None and not body.stream:
        raise ApiError(
            400,
            "stream_options: only allowed when stream is true; remove it or set stream",
            "stream_options",
        )
    include = body.stream_options is not None and body.stream_options.include_usage
    if body.return_token_times and body.stream and not include:
        raise ApiError(
            400,
            "return_token_times: a stream carries the token times in its usage chunk; set "
            "stream_options.include_usage to true",
            "return_token_times",
        )


class ChatPlan(NamedTuple):
    req: GenerateReq
    parser: Callable[[], ChatOutputParser] | None  # one per choice; None: no parsing


def chat_request(body: ChatCompletionRequest, parsing: ChatParsing) -> ChatPlan:
    check_supported(body)
    check_stream_fields(body)
    if body.store:
        raise ApiError(400, "store: this server keeps no answers; leave it out or false", "store")
    top = body.top_logprobs or 0
    if top and not body.logprobs:
        raise ApiError(400, "top_logprobs: requires logprobs to be true", "top_logprobs")
    other = request_grammar(body)
    plan = tool_plan(
        body.tools or [],
        body.tool_choice,
        body.parallel_tool_calls,
        parsing.tool_call_parser,
        other.field.split(".")[0] if other is not None else None,
    )
    forced = GrammarField("tool_calls", plan.grammar, "tools") if plan.grammar else None
    params, grammar_field = sampling_params(body, body.logprobs, top, forced)
    base = new_rid()
    options = chat_options(body, plan.template_tools)
    req = GenerateReq(
        rids=[f"{base}-{i}" for i in range(body.n)],
        seeds=choice_seeds(body.seed, body.n),
        params=params,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        messages=[chat_message(m) for m in body.messages],
        chat=options,
        grammar_field=grammar_field,
    )
    thinking = options.template_kwargs.get("enable_thinking", True) is not False
    if thinking and parsing.reasoning_parser is not None and params.constraint is not None:
        req.grammar_after = THINK_END  # the answer follows the grammar, not the thinking
    return ChatPlan(req, parser_factory(plan, parsing, thinking))


def chat_message(m: ChatMessageIn) -> ChatMessage:
    calls = [ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ()]
    return ChatMessage(m.role, m.text, m.name, calls, m.tool_call_id)


def chat_options(body: ChatCompletionRequest, tools: list[dict[str, Any]]) -> ChatOptions:
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        # Templates that can think take `enable_thinking`; an explicit kwarg wins.
        kwargs.setdefault("enable_thinking", body.reasoning_effort not in ("none", "minimal"))
    return ChatOptions(tools, list(body.documents or ()), kwargs)


def completion_requests(body: CompletionRequest) -> list[GenerateReq]:
    check_supported(body)
    check_stream_fields(body)
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


def usage(
    results: list[ChoiceResult], n: int, token_times: bool = False, received: float = 0.0
) -> dict[str, Any]:
    """Prompts count once however many choices share them. `token_times`: add, per choice,
    when the scheduler had each output token (the server's own token timestamps), and
    `received_at`, when the API server took the request (`received`)."""
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
        out["received_at"] = received
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
    """`top`: each token's top alternatives (the request's `logprobs` of them) and the sampled
    token itself, as OpenAI gives them: up to logprobs + 1 entries."""
    offsets = []
    for t in lps:
        offsets.append(offset)
        offset += len(t.token)
    return {
        "tokens": [t.token for t in lps],
        "token_logprobs": [t.logprob for t in lps],
        "top_logprobs": [_top_with_sampled(t) for t in lps] if top else None,
        "text_offset": offsets,
    }


def _top_with_sampled(t: TokenLogprob) -> dict[str, float]:
    top = {x.token: x.logprob for x in t.top}
    top.setdefault(t.token, t.logprob)
    return top


@dataclass(frozen=True)
class ResponseMeta:
    id: str
    model: str
    received: float  # when the handler took the request (seconds since the epoch)

    @property
    def created(self) -> int:
        return int(self.received)

    def envelope(self, obj: str, choices: list[Any]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, obj: str, include_usage: bool) -> dict[str, Any]:
        """A stream chunk's body around its choice (`usage` null when the stream ends with
        it)."""
        body = self.envelope(obj, [CHOICE])
        return {**body, "usage": None} if include_usage else body


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
    request: Request,
    body: ChatCompletionRequest,
    client: EngineClient,
    model: str,
    parsing: ChatParsing,
) -> Response:
    req, make_parser = chat_request(body, parsing)
    meta = ResponseMeta(f"chatcmpl-{new_rid()}", model, time.time())
    if body.stream:
        include = body.stream_options is not None and body.stream_options.include_usage
        stream = submit(client, [req])
        first = await first_batch(request, stream)
        opts = ChatStreamOptions(
            body.n, body.logprobs, include, body.return_token_times, make_parser, parsing
        )
        return EventStreamResponse(_chat_events(stream, first, meta, opts), stream)

    def respond(results: list[ChoiceResult]) -> dict[str, Any]:
        choices = [
            {
                "index": i,
                **assistant_message(
                    r.text, r.finish_reason, make_parser() if make_parser else None
                ),
                "logprobs": chat_logprobs(r.logprobs) if body.logprobs else None,
            }
            for i, r in enumerate(results)
        ]
        return {
            **meta.envelope("chat.completion", choices),
            "usage": usage(results, body.n, body.return_token_times, meta.received),
        }

    return await _run(request, client, [req], body.n, respond)


def chat_deltas(d: ChatDelta) -> list[dict[str, Any]]:
    """The deltas of a parsed piece, as OpenAI streams them: the reasoning, the content, and
    per call first its index, id and name, then its arguments as they are written (one delta
    per call and piece)."""
    out: list[dict[str, Any]] = []
    if d.reasoning:
        out.append({"reasoning_content": d.reasoning})
    if d.content:
        out.append({"content": d.content})
    for f in d.fragments:
        if f.id is not None:
            function = {"name": f.name, "arguments": ""}
            call = {"index": f.index, "id": f.id, "type": "function", "function": function}
            out.append({"tool_calls": [call]})
            continue
        last = out[-1]["tool_calls"][0] if out and "tool_calls" in out[-1] else None
        if last is not None and last["index"] == f.index and "id" not in last:
            last["function"]["arguments"] += f.arguments
        else:
            call = {"index": f.index, "function": {"arguments": f.arguments}}
            out.append({"tool_calls": [call]})
    return out


async def completions(
    request: Request, body: CompletionRequest, client: EngineClient, model: str
) -> Response:
    reqs = completion_requests(body)
    meta = ResponseMeta(f"cmpl-{new_rid()}", model, time.time())
    num_choices = len(reqs) * body.n
    want_lp = top = body.logprobs is not None
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
            "usage": usage(results, body.n, body.return_token_times, meta.received),
        }

    return await _run(request, client, reqs, num_choices, respond)


async def _batches(
    stream: RequestStream, first: list[ChoiceOutput]
) -> AsyncIterator[list[ChoiceOutput]]:
    yield first
    async for batch in stream:
        yield batch


@dataclass(frozen=True)
class ChatStreamOptions:
    n: int
    logprobs: bool
    include_usage: bool
    token_times: bool
    make_parser: Callable[[], ChatOutputParser] | None
    parsing: ChatParsing


# The most common choices of stream chunks, written as `json.dumps` writes them.


def _content_choice(index: int, text: str) -> str:
    delta = f'{{"content": {json_str(text)}}}'
    return f'{{"index": {index}, "delta": {delta}, "logprobs": null, "finish_reason": null}}'


def _text_choice(index: int, text: str, reason: str | None) -> str:
    finish = "null" if reason is None else json_str(reason)
    text_json = json_str(text)
    return f'{{"index": {index}, "text": {text_json}, "logprobs": null, "finish_reason": {finish}}}'


async def _chat_events(
    stream: RequestStream,
    first: list[ChoiceOutput],
    meta: ResponseMeta,
    opts: ChatStreamOptions,
) -> AsyncIterator[bytes]:
    envelope = Envelope(meta.chunk("chat.completion.chunk", opts.include_usage))

    def chunk(index: int, delta: dict[str, Any], lps: Any, reason: str | None) -> bytes:
        if lps is None and reason is None and delta.keys() == {"content"}:  # most events
            return envelope.event(_content_choice(index, delta["content"]))
        return envelope.event(
            {"index": index, "delta": delta, "logprobs": lps, "finish_reason": reason}
        )

    n = opts.n
    results = [ChoiceResult() for _ in range(n)]
    parsers = [opts.make_parser() if opts.make_parser else None for _ in range(n)]
    yield b"".join(chunk(i, {"role": "assistant", "content": ""}, None, None) for i in range(n))
    async for batch in _batches(stream, first):
        events = []
        for co in batch:
            out, parser = co.out, parsers[co.index]
            results[co.index].add(out)
            lps = chat_logprobs(out.logprobs) if opts.logprobs and out.logprobs else None
            if parser is None:
                deltas = [{"content": out.text}] if out.text or lps else []
            else:
                d = parser.feed(out.text)
                if out.finished:
                    d += parser.finish()
                deltas = chat_deltas(d) or ([{"content": ""}] if lps else [])
            for k, delta in enumerate(deltas):
                events.append(chunk(co.index, delta, lps if k == 0 else None, None))
            if out.finished:
                called = parser is not None and parser.num_calls > 0
                reason = calls_finish(out.finish_reason, called)
                events.append(chunk(co.index, {}, None, reason))
        yield b"".join(events)
    if opts.include_usage:
        body = meta.envelope("chat.completion.chunk", [])
        yield sse({**body, "usage": usage(results, n, opts.token_times, meta.received)})
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
    envelope = Envelope(meta.chunk("text_completion", include_usage))
    async for batch in _batches(stream, first):
        events = []
        for co in batch:
            out, i = co.out, co.index
            results[i].add(out)
            reason = out.finish_reason if out.finished else None
            if not want_lp:  # most events
                events.append(envelope.event(_text_choice(i, out.text, reason)))
                continue
            lps = completion_logprobs(out.logprobs, offsets[i], top)
            offsets[i] += sum(len(t.token) for t in out.logprobs)
            choice = {"index": i, "text": out.text, "logprobs": lps, "finish_reason": reason}
            events.append(envelope.event(choice))
        yield b"".join(events)
    if include_usage:
        final = usage(results, n, token_times, meta.received)
        yield sse({**meta.envelope("text_completion", []), "usage": final})
    yield DONE
