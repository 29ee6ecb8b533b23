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
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
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
    (
        "hermes",  # a second call cut off (a length limit) leaves the first one standing
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "b", "argu',
        '\n<tool_call>\n{"name": "b", "argu',
        [("a", {"x": 1})],
    ),
    ("hermes", '<tool_call>{"arguments": {"x": 1}, "name": "a"}</tool_call>', "", [("a", {"x": 1})]),
    ("hermes", '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>', "", [("a", {"x": 1})]),
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
    (None, '{"answer": 42}', '{"answer": 42}', []),
    (
        "deepseek",
        f'{DS_BEGIN}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{"city": "Paris", "unit": "celsius"}}\n```{DS_CALL_END}{DS_END}',
        "",
        [("get_weather", WEATHER)],
    ),
    (
        "deepseek",
        f'Checking both.\n{DS_BEGIN}{DS_CALL}function{DS_SEP}a\n```json\n{{"x": "```"}}\n```{DS_CALL_END}\n'
        f'{DS_CALL}function{DS_SEP}b\n```json\n{{}}\n```{DS_CALL_END}{DS_END} Done.',
        "Checking both.\n Done.",
        [("a", {"x": "```"}), ("b", {})],
    ),
    (  # V3.1 writes the name before the separator and no fence
        "deepseek",
        f'{DS_BEGIN}{DS_CALL}get_weather{DS_SEP}{{"city": "Paris", "unit": "celsius"}}{DS_CALL_END}{DS_END}',
        "",
        [("get_weather", WEATHER)],
    ),
    (  # arguments written as a JSON string, as the templates' `tojson` renders them
        "deepseek",
        f'{DS_BEGIN}{DS_CALL}function{DS_SEP}a\n```json\n"{{\\"x\\": 1}}"\n```{DS_CALL_END}{DS_END}',
        "",
        [("a", {"x": 1})],
    ),
    (
        "deepseek",
        f'{DS_BEGIN}{DS_CALL}function{DS_SEP}a\n```python\nprint(1)\n```{DS_CALL_END}{DS_END}',
        f'{DS_BEGIN}{DS_CALL}function{DS_SEP}a\n```python\nprint(1)\n```{DS_CALL_END}{DS_END}',
        [],
    ),
    ("deepseek", "no <｜tool here", "no <｜tool here", []),
    ("deepseek", f"{DS_BEGIN}{DS_END}", f"{DS_BEGIN}{DS_END}", []),
]  # fmt: skip


def calls_of(delta: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.name, json.loads(c.arguments)) for c in delta.calls]


def streamed(parser: Any, pieces: list[str]) -> tuple[str, list[Any], list[Any]]:
    """The content, calls and call fragments of `pieces` fed one by one."""
    parts = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    content = "".join(d.content for d in parts)
    return content, [c for d in parts for c in d.calls], [f for d in parts for f in d.fragments]


def check_fragments(fragments: list[Any], calls: list[Any]) -> None:
    """Each call's first fragment carries its id and name and no arguments; the rest, joined,
    are exactly its arguments."""
    assert sorted({f.index for f in fragments}) == [c.index for c in calls]
    for c in calls:
        mine = [f for f in fragments if f.index == c.index]
        assert (mine[0].id, mine[0].name, mine[0].arguments) == (c.id, c.name, "")
        assert all(f.id is None and f.name is None and f.arguments for f in mine[1:])
        assert "".join(f.arguments for f in mine[1:]) == c.arguments


@pytest.mark.parametrize(("name", "output", "content", "calls"), CASES)
def test_whole_output(
    name: str | None, output: str, content: str, calls: list[tuple[str, Any]]
) -> None:
    d = tool_call_parser(name).parse(output)
    assert d.content == content
    assert calls_of(d) == calls
    assert [c.index for c in d.calls] == list(range(len(calls)))
    assert len({c.id for c in d.calls}) == len(calls)
    check_fragments(d.fragments, d.calls)


@pytest.mark.parametrize(("name", "output", "content", "calls"), CASES)
def test_streamed_split_anywhere(
    name: str | None, output: str, content: str, calls: list[tuple[str, Any]]
) -> None:
    whole = tool_call_parser(name).parse(output)
    splits = [[output[:i], output[i:]] for i in range(len(output) + 1)]
    for pieces in [*splits, list(output)]:
        got_content, got_calls, fragments = streamed(tool_call_parser(name), pieces)
        assert got_content == content, pieces
        assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls, pieces
        assert [c.arguments for c in got_calls] == [c.arguments for c in whole.calls], pieces
        check_fragments(fragments, got_calls)


def test_arguments_stream_as_written() -> None:
    """A call's head goes out as soon as its name and the start of its arguments are written;
    then each piece of the arguments goes out with the piece that wrote it."""
    head = '<tool_call>\n{"name": "get_weather", "arguments": {'
    p = tool_call_parser("hermes")
    assert p.feed('<tool_call>\n{"name": "get_weather", "argu').fragments == []
    first, brace = p.feed('ments": {').fragments
    assert (first.index, first.name, first.arguments, brace.arguments) == (
        0,
        "get_weather",
        "",
        "{",
    )
    assert [f.arguments for f in p.feed('"city": "Pa').fragments] == ['"city": "Pa']
    assert [f.arguments for f in p.feed('ris"}} \n</tool_call>').fragments] == ['ris"}']
    assert [c.arguments for c in p.finish().calls] == []
    assert tool_call_parser("hermes").parse(head + '"city": "Paris"}}</tool_call>').calls


def test_streamed_call_cut_off_stays_a_call() -> None:
    """Once a call's head went out it cannot be taken back: an output cut off in its arguments
    (a length limit) ends it with what was written. Known whole, the same output is content."""
    output = '{"name": "a", "parameters": {"x": 1'
    assert tool_call_parser("llama3").parse(output).content == output
    content, calls, fragments = streamed(tool_call_parser("llama3"), [output[:29], output[29:]])
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("a", '{"x": 1')]
    check_fragments(fragments, calls)
    content, calls, _ = streamed(tool_call_parser("llama3"), [output[:28]])
    assert content == output[:28] and calls == []  # cut before the arguments: held, given back


def test_text_after_a_streamed_call_is_content() -> None:
    p = tool_call_parser("hermes")
    d = p.feed('<tool_call>{"name": "a", "arguments": {"x"')
    d += p.feed(": 1}} and more</tool_call>")
    d += p.finish()
    assert [(c.name, c.arguments) for c in d.calls] == [("a", '{"x": 1}')]
    assert d.content == " and more</tool_call>"


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
    assert detect_tool_call_parser("{{ '<｜tool▁calls▁begin｜>' }}") == "deepseek"
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
