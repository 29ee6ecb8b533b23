"""The tool-call pipeline both front doors share (`minisgl.tokenizer.tools`): what `tool_choice`
offers, forces or withholds, and the assistant message a parsed output becomes."""

from __future__ import annotations

import pytest

from minisgl.core import InvalidRequestError
from minisgl.tokenizer.tools import assistant_message, output_parser, tool_plan

TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("get_weather", "get_time")
]


def test_tool_choice_offers_forces_or_withholds_the_tools() -> None:
    assert tool_plan(TOOLS, None, True, "hermes") == (TOOLS, True, None)
    assert tool_plan(TOOLS, "auto", True, None) == (TOOLS, False, None)  # no known format
    assert tool_plan(TOOLS, "none", True, "hermes") == ([], False, None)
    assert tool_plan([], None, True, "hermes") == ([], False, None)
    forced = tool_plan(TOOLS, "required", False, "hermes")
    assert forced.parse and forced.template_tools == TOOLS and forced.grammar is not None
    assert "get_weather" in forced.grammar and "get_time" in forced.grammar
    named = tool_plan(TOOLS, {"type": "function", "function": {"name": "get_time"}}, True, None)
    assert named.grammar is not None and "get_weather" not in named.grammar


@pytest.mark.parametrize(
    ("tools", "choice", "other", "message"),
    [
        ([], "required", None, "tool_choice: forcing a call needs `tools`"),
        ([], "auto", None, "tool_choice: 'auto' is only allowed with `tools`"),
        (TOOLS, "required", "regex", "tool_choice: a forced call cannot also follow regex"),
        (TOOLS, {"function": {"name": "nope"}}, None, "tool_choice: no tool is named 'nope'"),
        ([{"name": "f"}], "auto", None, "tools: each is"),
    ],
)
def test_mistakes_name_their_field(tools, choice, other, message) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        tool_plan(tools, choice, True, "hermes", other)


def test_a_parsed_answer_becomes_an_assistant_message() -> None:
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    out = assistant_message(text, "stop", output_parser(True, "hermes", None, True))
    [call] = out["message"]["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    assert out["finish_reason"] == "tool_calls" and out["message"]["content"] is None
    assert "reasoning_content" not in out["message"]
    thought = assistant_message(
        "<think>hm</think>Hi", "length", output_parser(False, None, "qwen3", True)
    )
    assert thought == {
        "message": {"role": "assistant", "content": "Hi", "reasoning_content": "hm"},
        "finish_reason": "length",
    }
    assert assistant_message("Hi", "stop", None)["message"] == {
        "role": "assistant",
        "content": "Hi",
    }
