"""Tools and reasoning in chat requests: the server's parsers, and OpenAI's tool fields through
the pipeline both front doors share (`minisgl.tokenizer.tools`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from minisgl.core import InvalidRequestError
from minisgl.server.errors import ApiError
from minisgl.server.protocol import NamedToolChoice, Tool
from minisgl.tokenizer.parsers import ChatOutputParser
from minisgl.tokenizer.tools import ToolPlan, output_parser
from minisgl.tokenizer.tools import tool_plan as shared_tool_plan


@dataclass(frozen=True)
class ChatParsing:
    """The server's parsers: the tool-call format (flag or detected) and the reasoning one."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


def tool_plan(
    tools: list[Tool],
    choice: str | NamedToolChoice | None,
    parallel: bool,
    parser: str | None,
    other_grammar: str | None,
) -> ToolPlan:
    """`other_grammar`: the request field of another constraint, if it has one."""
    named = choice.model_dump() if isinstance(choice, NamedToolChoice) else choice
    dumped = [t.model_dump(exclude_none=True) for t in tools]
    try:
        return shared_tool_plan(dumped, named, parallel, parser, other_grammar)
    except InvalidRequestError as e:
        raise ApiError.from_invalid(e) from e


def parser_factory(
    plan: ToolPlan, parsing: ChatParsing, thinking: bool
) -> Callable[[], ChatOutputParser] | None:
    """A fresh output parser per choice; None when nothing is split off."""
    if not plan.parse and parsing.reasoning_parser is None:
        return None
    return partial(
        output_parser, plan.parse, parsing.tool_call_parser, parsing.reasoning_parser, thinking
    )
