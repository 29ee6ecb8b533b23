"""Tools and reasoning in chat requests: what the chat template sees, the grammar a forced
call follows, and the parser that splits each choice's output."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from minisgl.constrain import GrammarError
from minisgl.constrain.tools import CallLayout, ForcedCalls, FunctionSchema
from minisgl.server.errors import ApiError
from minisgl.server.protocol import NamedToolChoice, Tool
from minisgl.server.sampling import GrammarField
from minisgl.tokenizer.parsers import (
    ChatOutputParser,
    ParsedCall,
    ReasoningSplitter,
    call_format,
    tool_call_parser,
)


@dataclass(frozen=True)
class ChatParsing:
    """The server's parsers: the tool-call format (flag or detected) and the reasoning one."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


class ToolPlan(NamedTuple):
    template_tools: list[dict[str, Any]]  # what the chat template renders
    parse: bool  # whether the output is parsed for calls
    grammar: GrammarField | None  # a forced call's


def tool_plan(
    tools: list[Tool],
    choice: str | NamedToolChoice | None,
    parallel: bool,
    parser: str | None,
    other_grammar: str | None,
) -> ToolPlan:
    """`other_grammar`: the request field of another constraint, if it has one."""
    choice = choice if choice is not None else ("auto" if tools else "none")
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    if forced and not tools:
        raise ApiError(400, "tool_choice: forcing a call needs `tools`", "tool_choice")
    if forced and other_grammar is not None:
        raise ApiError(
            400,
            f"tool_choice: a forced call cannot also follow {other_grammar}; drop one of them",
            "tool_choice",
        )
    dumped = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "none":
        # The template does not offer the tools: the model answers in words.
        return ToolPlan([], False, None)
    if choice == "auto":
        return ToolPlan(dumped, parser is not None, None)
    functions = [FunctionSchema(t.function.name, t.function.parameters) for t in tools]
    if isinstance(choice, NamedToolChoice):
        functions = [f for f in functions if f.name == choice.function.name]
        if not functions:
            names = ", ".join(t.function.name for t in tools)
            raise ApiError(
                400,
                f"tool_choice: no tool is named {choice.function.name!r} (tools: {names})",
                "tool_choice",
            )
    fmt = call_format(parser)
    layout = CallLayout(
        fmt.args_key, fmt.open, fmt.close, fmt.separator, fmt.array, fmt.call_head, fmt.call_tail
    )
    calls = ForcedCalls(functions, layout, parallel)
    try:
        calls.check()  # the grammar itself is built with the other grammars, off this loop
    except GrammarError as e:
        raise ApiError(400, f"tools: {e.reason}", "tools") from e
    return ToolPlan(dumped, True, GrammarField("tool_calls", calls.to_text(), "tools"))


def parser_factory(
    plan: ToolPlan, parsing: ChatParsing, thinking: bool
) -> Callable[[], ChatOutputParser] | None:
    """A fresh output parser per choice; None when nothing is split off."""
    if not plan.parse and parsing.reasoning_parser is None:
        return None

    def make() -> ChatOutputParser:
        tools = tool_call_parser(parsing.tool_call_parser) if plan.parse else None
        reasoning = (
            ReasoningSplitter(parsing.reasoning_parser, thinking)
            if parsing.reasoning_parser is not None
            else None
        )
        return ChatOutputParser(tools, reasoning)

    return make


def tool_call_json(call: ParsedCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
