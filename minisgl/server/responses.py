"""`/v1/responses`, stateless: a Responses request becomes a chat request (the same template,
grammar and parsers), and the chat answer becomes a response object, or the SDK's typed
events while streaming. Nothing is stored, so `store: true` and `previous_response_id` are
refused."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from minisgl.config import ChatConfig
from minisgl.server.engine_client import EngineClient
from minisgl.server.errors import ApiError
from minisgl.server.openai_api import chat_request
from minisgl.server.protocol import (
    ChatCompletionRequest,
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ResponsesRequest,
)
from minisgl.server.sampling import new_rid
from minisgl.server.streaming import Batches, ChoiceResult, answer, sse
from minisgl.tokenizer.parsers import ChatDelta, ChatOutputParser, ParsedCall

# ---- request -------------------------------------------------------------------------------


def chat_body(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that asks for the same answer."""
    if body.store:
        raise ApiError(400, "store: this server keeps no responses; leave it out or false", "store")
    if body.previous_response_id is not None:
        raise ApiError(
            400,
            "previous_response_id: this server keeps no responses; send the whole conversation "
            "in `input`",
            "previous_response_id",
        )
    chat: dict[str, Any] = {
        "messages": messages(body),
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "parallel_tool_calls": body.parallel_tool_calls,
        "reasoning_effort": body.reasoning.effort if body.reasoning else None,
    }
    if body.tools:
        chat["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in body.tools
        ]
    choice = body.tool_choice
    if isinstance(choice, str):
        chat["tool_choice"] = choice
    elif choice is not None:
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise ApiError(400, "text.format.schema: required for json_schema", "text.format")
        schema = {"name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in chat.items() if v is not None}
        )
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ApiError(400, f"input: {where}: {first['msg']}", "input") from None


def messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if body.instructions:
        out.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*out, {"role": "user", "content": body.input}]
    for item in body.input:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    if not out:
        raise ApiError(400, "input: holds no message", "input")
    return out


# ---- response ------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{new_rid()}"


def text_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [part] if status == "completed" else []}  # fmt: skip


def call_item(item_id: str, call: ParsedCall, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status == "completed" else "", "status": status}  # fmt: skip


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def output_items(d: ChatDelta) -> list[dict[str, Any]]:
    out = [reasoning_item(new_id("rs"), d.reasoning)] if d.reasoning else []
    if d.content.strip() or not d.calls:
        out.append(text_item(new_id("msg"), d.content, "completed"))
    out += [call_item(new_id("fc"), c, "completed") for c in d.calls]
    return out


@dataclass
class Envelope:
    """What every response object of one request repeats."""

    body: ResponsesRequest
    id: str
    model: str
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(
        self, status: str, output: list[dict[str, Any]], result: ChoiceResult | None
    ) -> dict[str, Any]:
        b = self.body
        incomplete = result is not None and result.finish_reason == "length"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": "incomplete" if incomplete else status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None,
            "output": output,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "temperature": b.temperature,
            "top_p": b.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or ()],
            "tool_choice": _tool_choice(b),
            "parallel_tool_calls": b.parallel_tool_calls,
            "text": {"format": b.text.format.model_dump(by_alias=True, exclude_none=True)}
            if b.text is not None and b.text.format is not None
            else {"format": {"type": "text"}},
            "metadata": b.metadata or {},
            "store": False,
            "usage": _usage(result) if result is not None else None,
        }


def _tool_choice(b: ResponsesRequest) -> Any:
    if b.tool_choice is None:
        return "auto"
    return b.tool_choice if isinstance(b.tool_choice, str) else b.tool_choice.model_dump()


def _usage(r: ChoiceResult) -> dict[str, Any]:
    return {
        "input_tokens": r.prompt_tokens,
        "input_tokens_details": {"cached_tokens": r.cached_tokens},
        "output_tokens": r.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": r.prompt_tokens + r.completion_tokens,
    }


async def create_response(
    request: Request, body: ResponsesRequest, client: EngineClient, model: str, chat: ChatConfig
) -> Response:
    req, make_parser = chat_request(chat_body(body), chat)
    env = Envelope(body, new_id("resp"), model)

    def whole(results: list[ChoiceResult]) -> dict[str, Any]:
        [r] = results
        d = make_parser().parse(r.text) if make_parser is not None else ChatDelta(r.text)
        return env.response("completed", output_items(d), r)

    def events(batches: Batches) -> AsyncIterator[bytes]:
        return _events(batches, env, make_parser)

    return await answer(request, client, [req], 1, body.stream, events, whole)


# ---- streaming -----------------------------------------------------------------------------


@dataclass
class _Open:
    """An output item being written."""

    kind: str  # "reasoning" | "message" | "function_call"
    id: str
    index: int  # in the output
    text: str = ""


class ResponseEvents:
    """The typed events of one streamed response, numbered in order."""

    def __init__(self, env: Envelope) -> None:
        self.env = env
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: _Open | None = None
        self.calls: dict[int, _Open] = {}  # by the call's index: those being written

    def event(self, kind: str, **fields: Any) -> bytes:
        self.seq += 1
        return sse({"type": f"response.{kind}", "sequence_number": self.seq - 1, **fields})

    def item(self, what: str, o: _Open, item: dict[str, Any]) -> bytes:
        """`output_item.added` or `output_item.done`, of item `o`."""
        return self.event(f"output_item.{what}", output_index=o.index, item=item)

    def start(self) -> list[bytes]:
        snapshot = self.env.response("in_progress", [], None)
        return [
            self.event("created", response=snapshot),
            self.event("in_progress", response=snapshot),
        ]

    def add(self, d: ChatDelta) -> list[bytes]:
        out: list[bytes] = []
        if d.reasoning:
            out += self._text("reasoning", d.reasoning)
        calls_first = bool(self.calls)  # the content came after the open call's end
        if calls_first:
            out += self._calls(d)
        if d.content:
            out += self._text("message", d.content)
        if not calls_first:
            out += self._calls(d)
        return out

    def _calls(self, d: ChatDelta) -> list[bytes]:
        """A call's item opens with its first fragment, its arguments stream as delta events,
        and it closes when the call is complete."""
        out: list[bytes] = []
        for f in d.fragments:
            if f.id is not None:
                out += self._close()
                call = ParsedCall(f.index, f.id, f.name or "", "")
                o = self.calls[f.index] = _Open("function_call", new_id("fc"), len(self.output))
                self.output.append(call_item(o.id, call, "in_progress"))
                out.append(self.item("added", o, self.output[-1]))
                continue
            o = self.calls[f.index]
            ids = {"item_id": o.id, "output_index": o.index}
            out.append(self.event("function_call_arguments.delta", **ids, delta=f.arguments))
        for c in d.calls:
            o = self.calls.pop(c.index)
            ids = {"item_id": o.id, "output_index": o.index}
            item = self.output[o.index] = call_item(o.id, c, "completed")
            out.append(
                self.event(
                    "function_call_arguments.done", **ids, arguments=c.arguments, name=c.name
                )
            )
            out.append(self.item("done", o, item))
        return out

    def _text(self, kind: str, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self.open is None or self.open.kind != kind:
            out += self._close()
            out += self._open(kind)
        assert self.open is not None
        self.open.text += text
        ids = {"item_id": self.open.id, "output_index": self.open.index, "content_index": 0}
        if kind == "reasoning":
            out.append(self.event("reasoning_text.delta", **ids, delta=text))
        else:
            out.append(self.event("output_text.delta", **ids, delta=text, logprobs=[]))
        return out

    def _open(self, kind: str) -> list[bytes]:
        o = self.open = _Open(
            kind, new_id("rs" if kind == "reasoning" else "msg"), len(self.output)
        )
        self.output.append({})  # filled in when the item closes
        if kind == "reasoning":
            return [self.item("added", o, {"type": "reasoning", "id": o.id, "summary": []})]
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        ids = {"item_id": o.id, "output_index": o.index, "content_index": 0}
        return [
            self.item("added", o, text_item(o.id, "", "in_progress")),
            self.event("content_part.added", **ids, part=part),
        ]

    def _close(self) -> list[bytes]:
        o, self.open = self.open, None
        if o is None:
            return []
        ids = {"item_id": o.id, "output_index": o.index, "content_index": 0}
        if o.kind == "reasoning":
            item = self.output[o.index] = reasoning_item(o.id, o.text)
            done = self.event("reasoning_text.done", **ids, text=o.text)
            return [done, self.item("done", o, item)]
        item = self.output[o.index] = text_item(o.id, o.text, "completed")
        return [
            self.event("output_text.done", **ids, text=o.text, logprobs=[]),
            self.event("content_part.done", **ids, part=item["content"][0]),
            self.item("done", o, item),
        ]

    def finish(self, result: ChoiceResult) -> list[bytes]:
        out = self._close()
        if not self.output:  # an empty answer is still one message
            out += self._open("message") + self._close()
        final = self.env.response("completed", self.output, result)
        kind = "completed" if final["status"] == "completed" else "incomplete"
        return [*out, self.event(kind, response=final)]


async def _events(
    batches: Batches, env: Envelope, make_parser: Callable[[], ChatOutputParser] | None
) -> AsyncIterator[bytes]:
    events = ResponseEvents(env)
    parser = make_parser() if make_parser is not None else None
    result = ChoiceResult()
    yield b"".join(events.start())
    async for batch in batches:
        out: list[bytes] = []
        for co in batch:
            result.add(co.out)
            d = parser.feed(co.out.text) if parser is not None else ChatDelta(co.out.text)
            if co.out.finished and parser is not None:
                d += parser.finish()
            out += events.add(d)
            if co.out.finished:
                out += events.finish(result)
        yield b"".join(out)
