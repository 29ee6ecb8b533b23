"""Tools and reasoning in a chat, one pipeline for both front doors (the server and the offline
`LLM`): what the chat template is shown for OpenAI's `tools` and `tool_choice`, the grammar a
forced call follows, the parser that splits each choice's output, and the assistant message
that output becomes."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

from minisgl.config import ChatConfig
from minisgl.constrain import GrammarError
from minisgl.constrain.tools import CallLayout, ForcedCalls, FunctionSchema
from minisgl.core import InvalidRequestError
from minisgl.tokenizer.parsers import (
    ChatOutputParser,
    ParsedCall,
    ReasoningSplitter,
    call_format,
    tool_call_parser,
)


class ToolPlan(NamedTuple):
    template_tools: list[dict[str, Any]]  # what the chat template renders
    parse: bool  # whether the output is parsed for calls
    grammar: str | None  # a forced call's `tool_calls` constraint (`ForcedCalls` as JSON)


def tool_plan(
    tools: list[dict[str, Any]],
    choice: str | dict[str, Any] | None,
    parallel: bool,
    parser: str | None,
    other_grammar: str | None = None,
) -> ToolPlan:
    """`tools`: OpenAI function objects; `choice`: `none`, `auto`, `required` or `{"type":
    "function", "function": {"name": ...}}` (None: `auto` with tools, else `none`); `parser`:
    the call format; `other_grammar`: the field of another constraint, if the request has one.
    A bad combination raises InvalidRequestError naming `tool_choice` or `tools`."""
    functions = [_function(t) for t in tools]
    if choice is not None and not tools:  # as OpenAI and vLLM answer (400), not ignored
        forced = choice == "required" or isinstance(choice, dict)
        raise InvalidRequestError(
            "tool_choice: forcing a call needs `tools`"
            if forced
            else f"tool_choice: {choice!r} is only allowed with `tools`; leave it out"
        )
    choice = choice if choice is not None else ("auto" if tools else "none")
    named = choice["function"]["name"] if isinstance(choice, dict) else None
    forced = choice == "required" or named is not None
    if forced and other_grammar is not None:
        raise InvalidRequestError(
            f"tool_choice: a forced call cannot also follow {other_grammar}; drop one of them"
        )
    if choice == "none":
        # The template does not offer the tools: the model answers in words.
        return ToolPlan([], False, None)
    if not forced:
        return ToolPlan(tools, parser is not None, None)
    if named is not None:
        functions = [f for f in functions if f.name == named]
        if not functions:
            names = ", ".join(_function(t).name for t in tools)
            raise InvalidRequestError(f"tool_choice: no tool is named {named!r} (tools: {names})")
    fmt = call_format(parser)
    layout = CallLayout(
        fmt.args_key, fmt.open, fmt.close, fmt.separator, fmt.array, fmt.call_head, fmt.call_tail
    )
    calls = ForcedCalls(functions, layout, parallel)
    try:
        calls.check()  # the grammar itself is built with the other grammars, off this loop
    except GrammarError as e:
        raise InvalidRequestError(f"tools: {e.reason}") from e
    return ToolPlan(tools, True, calls.to_text())


def _function(tool: dict[str, Any]) -> FunctionSchema:
    try:
        f = tool["function"]
        return FunctionSchema(f["name"], f.get("parameters"))
    except (KeyError, TypeError):
        raise InvalidRequestError(
            'tools: each is {"type": "function", "function": {"name": ..., "parameters": ...}}'
        ) from None


def choice_parsers(
    plan: ToolPlan, chat: ChatConfig, template_kwargs: dict[str, Any]
) -> tuple[bool, Callable[[], ChatOutputParser] | None]:
    """Whether the model thinks (its template's `enable_thinking`, on unless turned off), and
    a maker of one fresh output parser per choice (None when nothing is split off)."""
    thinking = template_kwargs.get("enable_thinking", True) is not False
    if not plan.parse and chat.reasoning_parser is None:
        return thinking, None
    parsers = (chat.tool_call_parser, chat.reasoning_parser, thinking)
    return thinking, partial(output_parser, plan.parse, *parsers)


def output_parser(
    parse_calls: bool, call_parser: str | None, reasoning_parser: str | None, thinking: bool
) -> ChatOutputParser:
    """A fresh parser for one choice: the thinking split off (with a reasoning parser), then the
    calls (with `parse_calls`, in `call_parser`'s format; None: bare JSON)."""
    reasoning = ReasoningSplitter(reasoning_parser, thinking) if reasoning_parser else None
    return ChatOutputParser(tool_call_parser(call_parser) if parse_calls else None, reasoning)


def assistant_message(
    text: str, finish_reason: str | None, parser: ChatOutputParser | None
) -> dict[str, Any]:
    """A whole choice's `message` and `finish_reason` in OpenAI's chat shape, its output split
    by `parser`: `content` (None when the answer is only calls), `reasoning_content` (with a
    reasoning parser) and `tool_calls`."""
    if parser is None:
        return {"message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
    d = parser.parse(text)
    message: dict[str, Any] = {"role": "assistant"}
    message["content"] = d.content if d.content.strip() or not d.calls else None
    if parser.reasoning is not None:
        message["reasoning_content"] = d.reasoning or None
    if d.calls:
        message["tool_calls"] = [tool_call_json(c) for c in d.calls]
    return {"message": message, "finish_reason": calls_finish(finish_reason, bool(d.calls))}


def calls_finish(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish reason: "tool_calls" for an answer that stopped after its calls."""
    return "tool_calls" if called and reason == "stop" else reason


def tool_call_json(call: ParsedCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
