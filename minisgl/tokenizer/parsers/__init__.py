"""Output parsers: a model's text split into content, reasoning and tool calls, whole or as a
stream of deltas. Pure string processing, one object per choice."""

from minisgl.tokenizer.parsers.base import CallFragment, ParsedCall, ParsedDelta, ToolCallParser
from minisgl.tokenizer.parsers.chat import ChatDelta, ChatOutputParser
from minisgl.tokenizer.parsers.reasoning import (
    REASONING_PARSERS,
    THINK_END,
    ReasoningSplitter,
)
from minisgl.tokenizer.parsers.tool_calls import (
    TOOL_CALL_PARSERS,
    CallFormat,
    call_format,
    detect_tool_call_parser,
    tool_call_parser,
)

__all__ = [
    "REASONING_PARSERS",
    "THINK_END",
    "TOOL_CALL_PARSERS",
    "CallFormat",
    "CallFragment",
    "ChatDelta",
    "ChatOutputParser",
    "ParsedCall",
    "ParsedDelta",
    "ReasoningSplitter",
    "ToolCallParser",
    "call_format",
    "detect_tool_call_parser",
    "tool_call_parser",
]
