"""`/v1/chat/completions` and `/v1/completions`: OpenAI requests to engine requests, and
engine outputs to OpenAI responses (JSON or server-sent events)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from fastapi import Request
from fastapi.responses import Response

from minisgl.config import ChatConfig
from minisgl.message import ChatOptions, GenerateReq, TokenLogprob
from minisgl.server.engine_client import EngineClient
from minisgl.server.errors import ApiError
from minisgl.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
)
from minisgl.server.sampling import (
    GrammarField,
    generate_req,
    new_rid,
    request_grammar,
    sampling_params,
)
from minisgl.server.streaming import (
    CHOICE,
    DONE,
    Batches,
    ChoiceResult,
    Envelope,
    answer,
    json_str,
    sse,
)
from minisgl.tokenizer.parsers import THINK_END, ChatDelta, ChatOutputParser
from minisgl.tokenizer.tokenize import message_from_dict
from minisgl.tokenizer.tools import assistant_message, calls_finish, choice_parsers, tool_plan

# ---- requests ------------------------------------------------------------------------------


def check_fields(body: ChatCompletionRequest | CompletionRequest) -> None:
    """Refuse the fields this server cannot honour, and stream options without a stream."""
    bad = body.unsupported()
    if bad:
        raise ApiError(
            400,
            f"{bad[0]}: not supported by this server yet; remove it (a server that ignored it "
            "would answer in a different shape than you asked for)",
            bad[0],
        )
    if body.stream_options is not None and not body.stream:
        raise ApiError(
            400,
            "stream_options: only allowed when stream is true; remove it or set stream",
            "stream_options",
        )
    if body.return_token_times and body.stream and not include_usage(body):
        raise ApiError(
            400,
            "return_token_times: a stream carries the token times in its usage chunk; set "
            "stream_options.include_usage to true",
            "return_token_times",
        )


def include_usage(body: ChatCompletionRequest | CompletionRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


class ChatPlan(NamedTuple):
    req: GenerateReq
    parser: Callable[[], ChatOutputParser] | None  # one per choice; None: no parsing


def chat_request(body: ChatCompletionRequest, chat: ChatConfig) -> ChatPlan:
    """`chat`: the server's parsers (the tool-call format, flag or detected, and the reasoning
    one)."""
    check_fields(body)
    if body.store:
        raise ApiError(400, "store: this server keeps no answers; leave it out or false", "store")
    top = body.top_logprobs or 0
    if top and not body.logprobs:
        raise ApiError(400, "top_logprobs: requires logprobs to be true", "top_logprobs")
    other = request_grammar(body)
    choice = body.tool_choice
    plan = tool_plan(
        [t.model_dump(exclude_none=True) for t in body.tools or ()],
        choice.model_dump() if isinstance(choice, NamedToolChoice) else choice,
        body.parallel_tool_calls,
        chat.tool_call_parser,
        other.field.split(".")[0] if other is not None else None,
    )
    forced = GrammarField("tool_calls", plan.grammar, "tools") if plan.grammar else None
    params, grammar_field = sampling_params(body, body.logprobs, top, forced)
    options = chat_options(body, plan.template_tools)
    thinking, parsers = choice_parsers(plan, chat, options.template_kwargs)
    messages = [message_from_dict(m.model_dump(exclude_none=True)) for m in body.messages]
    req = generate_req(
        body.n, body.seed, params, body.max_completion_tokens or body.max_tokens, grammar_field,
        messages=messages, chat=options,
    )  # fmt: skip
    if thinking and chat.reasoning_parser is not None and params.constraint is not None:
        req.grammar_after = THINK_END  # the answer follows the grammar, not the thinking
    return ChatPlan(req, parsers)


def chat_options(body: ChatCompletionRequest, tools: list[dict[str, Any]]) -> ChatOptions:
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        # Templates that can think take `enable_thinking`; an explicit kwarg wins.
        kwargs.setdefault("enable_thinking", body.reasoning_effort not in ("none", "minimal"))
    return ChatOptions(tools, list(body.documents or ()), kwargs)


def completion_requests(body: CompletionRequest) -> list[GenerateReq]:
    check_fields(body)
    prompts = body.prompts()
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ApiError(400, "prompt: must not be empty", "prompt")
    params, grammar_field = sampling_params(body, body.logprobs is not None, body.logprobs or 0)
    max_tokens = body.max_tokens or 16  # OpenAI's documented default
    return [
        generate_req(body.n, body.seed, params, max_tokens, grammar_field, text=p)
        if isinstance(p, str)
        else generate_req(body.n, body.seed, params, max_tokens, grammar_field, input_ids=p)
        for p in prompts
    ]


# ---- results -------------------------------------------------------------------------------


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


def completion_logprobs(lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """Each token's `top_logprobs`: its top alternatives (the request's `logprobs` of them) and
    the sampled token itself, as OpenAI gives them: up to logprobs + 1 entries."""
    offsets = []
    for t in lps:
        offsets.append(offset)
        offset += len(t.token)
    return {
        "tokens": [t.token for t in lps],
        "token_logprobs": [t.logprob for t in lps],
        "top_logprobs": [_top_with_sampled(t) for t in lps],
        "text_offset": offsets,
    }


def _top_with_sampled(t: TokenLogprob) -> dict[str, float]:
    top = {x.token: x.logprob for x in t.top}
    top.setdefault(t.token, t.logprob)
    return top


@dataclass(frozen=True)
class ResponseMeta:
    """What every body and chunk of one answer repeats, and what its usage reports."""

    id: str
    model: str
    obj: str  # the whole answer's `object`; a chunk's is "chat.completion.chunk" for a chat
    n: int
    token_times: bool
    received: float = 0.0  # when the handler took the request (seconds since the epoch)

    def envelope(self, choices: list[Any], chunk: bool = False) -> dict[str, Any]:
        obj = "chat.completion.chunk" if chunk and self.obj == "chat.completion" else self.obj
        created = int(self.received)
        return {"id": self.id, "object": obj, "created": created, "model": self.model,
                "choices": choices}  # fmt: skip

    def whole(self, choices: list[Any], results: list[ChoiceResult]) -> dict[str, Any]:
        return {**self.envelope(choices), "usage": self.usage(results)}

    def usage(self, results: list[ChoiceResult]) -> dict[str, Any]:
        """Prompts count once however many choices share them. With `token_times`, per choice
        when the scheduler had each output token (the server's own token timestamps), and
        `received_at`, when the API server took the request."""
        firsts = results[:: self.n]
        prompt = sum(r.prompt_tokens for r in firsts)
        completion = sum(r.completion_tokens for r in results)
        out: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in firsts)},
        }
        if self.token_times:
            out["token_times"] = [r.token_times for r in results]
            out["received_at"] = self.received
        return out

    def chunks(self, include_usage: bool) -> Envelope:
        """A stream chunk's body around its choice (`usage` null when the stream ends with
        it)."""
        body = self.envelope([CHOICE], chunk=True)
        return Envelope({**body, "usage": None} if include_usage else body)

    def usage_event(self, results: list[ChoiceResult]) -> bytes:
        return sse({**self.envelope([], chunk=True), "usage": self.usage(results)})


# ---- endpoints -----------------------------------------------------------------------------


async def chat_completions(
    request: Request,
    body: ChatCompletionRequest,
    client: EngineClient,
    model: str,
    chat: ChatConfig,
) -> Response:
    req, make_parser = chat_request(body, chat)
    meta = ResponseMeta(
        f"chatcmpl-{new_rid()}", model, "chat.completion", body.n, body.return_token_times,
        time.time(),
    )  # fmt: skip

    def whole(results: list[ChoiceResult]) -> dict[str, Any]:
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
        return meta.whole(choices, results)

    def events(batches: Batches) -> AsyncIterator[bytes]:
        return _chat_events(batches, meta, body.logprobs, include_usage(body), make_parser)

    return await answer(request, client, [req], body.n, body.stream, events, whole)


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
    meta = ResponseMeta(
        f"cmpl-{new_rid()}", model, "text_completion", body.n, body.return_token_times,
        time.time(),
    )  # fmt: skip
    num_choices = len(reqs) * body.n
    want_lp = body.logprobs is not None

    def whole(results: list[ChoiceResult]) -> dict[str, Any]:
        choices = [
            {
                "index": i,
                "text": r.text,
                "logprobs": completion_logprobs(r.logprobs, 0) if want_lp else None,
                "finish_reason": r.finish_reason,
            }
            for i, r in enumerate(results)
        ]
        return meta.whole(choices, results)

    def events(batches: Batches) -> AsyncIterator[bytes]:
        return _completion_events(batches, meta, num_choices, want_lp, include_usage(body))

    return await answer(request, client, reqs, num_choices, body.stream, events, whole)


# The most common choices of stream chunks, written as `json.dumps` writes them.


def _content_choice(index: int, text: str) -> str:
    delta = f'{{"content": {json_str(text)}}}'
    return f'{{"index": {index}, "delta": {delta}, "logprobs": null, "finish_reason": null}}'


def _text_choice(index: int, text: str, reason: str | None) -> str:
    finish = "null" if reason is None else json_str(reason)
    text_json = json_str(text)
    return f'{{"index": {index}, "text": {text_json}, "logprobs": null, "finish_reason": {finish}}}'


async def _chat_events(
    batches: Batches,
    meta: ResponseMeta,
    logprobs: bool,
    include_usage: bool,
    make_parser: Callable[[], ChatOutputParser] | None,
) -> AsyncIterator[bytes]:
    envelope = meta.chunks(include_usage)

    def chunk(index: int, delta: dict[str, Any], lps: Any, reason: str | None) -> bytes:
        if lps is None and reason is None and delta.keys() == {"content"}:  # most events
            return envelope.event(_content_choice(index, delta["content"]))
        return envelope.event(
            {"index": index, "delta": delta, "logprobs": lps, "finish_reason": reason}
        )

    n = meta.n
    results = [ChoiceResult() for _ in range(n)]
    parsers = [make_parser() if make_parser else None for _ in range(n)]
    yield b"".join(chunk(i, {"role": "assistant", "content": ""}, None, None) for i in range(n))
    async for batch in batches:
        events = []
        for co in batch:
            out, parser = co.out, parsers[co.index]
            results[co.index].add(out)
            lps = chat_logprobs(out.logprobs) if logprobs and out.logprobs else None
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
    if include_usage:
        yield meta.usage_event(results)
    yield DONE


async def _completion_events(
    batches: Batches, meta: ResponseMeta, num_choices: int, want_lp: bool, include_usage: bool
) -> AsyncIterator[bytes]:
    results = [ChoiceResult() for _ in range(num_choices)]
    offsets = [0] * num_choices
    envelope = meta.chunks(include_usage)
    async for batch in batches:
        events = []
        for co in batch:
            out, i = co.out, co.index
            results[i].add(out)
            reason = out.finish_reason if out.finished else None
            if not want_lp:  # most events
                events.append(envelope.event(_text_choice(i, out.text, reason)))
                continue
            lps = completion_logprobs(out.logprobs, offsets[i])
            offsets[i] += sum(len(t.token) for t in out.logprobs)
            choice = {"index": i, "text": out.text, "logprobs": lps, "finish_reason": reason}
            events.append(envelope.event(choice))
        yield b"".join(events)
    if include_usage:
        yield meta.usage_event(results)
    yield DONE
