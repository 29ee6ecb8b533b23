"""Tool-call and reasoning parsers on canned model outputs of each format: single and parallel
calls, calls among text, malformed calls (plain content, never an error), and every output fed
as a stream split at each character boundary and one character at a time."""

from __future__ import annotations

import json
from typing import Any

import pytest

from minisgl.tokenizer.parsers import (
    ChatOutputParser,
    ReasoningSplitter,
    detect_tool_call_parser,
    tool_call_parser,
)

WEATHER = {"city": "Paris", "unit": "celsius"}
# (parser, output, expected content, expected calls as (name, arguments))
CASES: list[tuple[str | None, str, str, list[tuple[str, dict[str, Any]]]]] = [
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        "\n</tool_call>",
        "",
        [("get_weather", WEATHER)],
    ),
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"y": "</tool"}}\n</tool_call>',
        "Let me check.\n\n",
        [("a", {"x": 1}), ("b", {"y": "</tool"})],
    ),
    ("hermes", "<tool_call>\n{oops}\n</tool_call> done", "<tool_call>\n{oops}\n</tool_call> done", []),
    ("hermes", "no calls here, only <tool text", "no calls here, only <tool text", []),
    (
        "hermes",
        '<tool_call>{"name": "a", "arguments": {"x": 1}}',  # stopped before the closing tag
        "",
        [("a", {"x": 1})],
    ),
    ("hermes", '<tool_call>{"name": "a", "argu', '<tool_call>{"name": "a", "argu', []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    (
        "llama3",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        "",
        [("get_weather", WEATHER)],
    ),
    (
        "llama3",
        '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
        "",
        [("a", {"x": 1}), ("b", {})],
    ),
    ("llama3", "The weather is fine {really}.", "The weather is fine {really}.", []),
    ("llama3", '{"name": "a", "parameters": {"x": 1', '{"name": "a", "parameters": {"x": 1', []),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},'
        ' {"name": "b", "arguments": {}}]',
        "",
        [("get_weather", WEATHER), ("b", {})],
    ),
    ("mistral", 'Sure. [TOOL_CALLS]a[ARGS]{"x": 1}', "Sure. ", [("a", {"x": 1})]),
    ("mistral", '[{"name": "a", "arguments": {"x": 1}}]', "", [("a", {"x": 1})]),
    ("mistral", "[1] is a citation", "[1] is a citation", []),
    (None, '{"name": "a", "arguments": {"x": [1, 2]}}', "", [("a", {"x": [1, 2]})]),
    (None, '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]', "", [("a", {}), ("b", {})]),
    (None, "plain words", "plain words", []),
]  # fmt: skip


def calls_of(delta: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.name, json.loads(c.arguments)) for c in delta.calls]


def streamed(parser: Any, pieces: list[str]) -> tuple[str, list[Any]]:
    content, calls = "", []
    for piece in pieces:
        d = parser.feed(piece)
        content, calls = content + d.content, calls + d.calls
    d = parser.finish()
    return content + d.content, calls + d.calls


@pytest.mark.parametrize(("name", "output", "content", "calls"), CASES)
def test_whole_output(
    name: str | None, output: str, content: str, calls: list[tuple[str, Any]]
) -> None:
    d = tool_call_parser(name).parse(output)
    assert d.content == content
    assert calls_of(d) == calls
    assert [c.index for c in d.calls] == list(range(len(calls)))
    assert len({c.id for c in d.calls}) == len(calls)


@pytest.mark.parametrize(("name", "output", "content", "calls"), CASES)
def test_streamed_split_anywhere(
    name: str | None, output: str, content: str, calls: list[tuple[str, Any]]
) -> None:
    splits = [[output[:i], output[i:]] for i in range(len(output) + 1)]
    for pieces in [*splits, list(output)]:
        got_content, got_calls = streamed(tool_call_parser(name), pieces)
        assert got_content == content, pieces
        assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls, pieces


def test_mistral_ids_fit_its_templates() -> None:
    d = tool_call_parser("mistral").parse('[TOOL_CALLS][{"name": "a", "arguments": {}}]')
    assert len(d.calls[0].id) == 9 and d.calls[0].id.isalnum()


def test_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="hermes"):
        tool_call_parser("pythonic")


def test_detection_from_templates() -> None:
    assert detect_tool_call_parser("{{ '<tool_call>' }}") == "hermes"
    assert detect_tool_call_parser("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect_tool_call_parser("{{ '<|python_tag|>' }}") == "llama3"
    assert detect_tool_call_parser("{{ messages }}") is None
    assert detect_tool_call_parser(None) is None


# ---- reasoning -----------------------------------------------------------------------------

THINKING = [
    # (parser, thinking on, output, reasoning, content)
    ("qwen3", True, "<think>\nLet me see.\n</think>\n\nParis.", "\nLet me see.\n", "Paris."),
    ("qwen3", True, "Paris.", "", "Paris."),  # no <think>: the template turned it off
    ("qwen3", True, "<think>still thinking when cut off", "still thinking when cut off", ""),
    ("qwen3", True, "<thin air", "", "<thin air"),
    ("qwen3", False, "<think>x</think>y", "", "<think>x</think>y"),
    ("deepseek-r1", True, "Let me see.\n</think>\n\nParis.", "Let me see.\n", "Paris."),
    ("deepseek-r1", True, "<think>Hm.</think>Paris.", "Hm.", "Paris."),
    ("deepseek-r1", True, "no end tag", "no end tag", ""),
    ("deepseek-r1", False, "Paris.", "", "Paris."),
]


@pytest.mark.parametrize(("parser", "on", "output", "reasoning", "content"), THINKING)
def test_reasoning_split(parser: str, on: bool, output: str, reasoning: str, content: str) -> None:
    assert tuple(ReasoningSplitter(parser, on).split(output)) == (reasoning, content)
    splits = [[output[:i], output[i:]] for i in range(len(output) + 1)]
    for pieces in [*splits, list(output)]:
        s = ReasoningSplitter(parser, on)
        parts = [s.feed(p) for p in pieces] + [s.finish()]
        assert "".join(p.reasoning for p in parts) == reasoning, pieces
        assert "".join(p.content for p in parts) == content, pieces


def test_reasoning_then_tool_calls() -> None:
    output = '<think>I need the weather.</think>\n<tool_call>\n{"name": "w", "arguments": {}}\n</tool_call>'
    for pieces in ([output], list(output)):
        p = ChatOutputParser(tool_call_parser("hermes"), ReasoningSplitter("qwen3"))
        parts = [p.feed(x) for x in pieces] + [p.finish()]
        assert "".join(d.reasoning for d in parts) == "I need the weather."
        assert "".join(d.content for d in parts) == ""
        assert [c.name for d in parts for c in d.calls] == ["w"]
        assert p.num_calls == 1
