"""The grammar of a forced tool call accepts exactly the calls of the allowed functions whose
arguments follow their schemas, in the call format asked for."""

from __future__ import annotations

from typing import Any

import pytest

from minisgl.constrain import GrammarCompiler, GrammarError, RequestGrammar
from minisgl.constrain.tools import CallLayout, ForcedCalls, FunctionSchema, forced_calls_grammar
from minisgl.core import Constraint
from minisgl.tokenizer.parsers import call_format, tool_call_parser

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}},
    "required": ["city"],
    "additionalProperties": False,
}
FUNCTIONS = [FunctionSchema("get_weather", CITY), FunctionSchema("now", None)]
HERMES = CallLayout("arguments", "<tool_call>\n", "\n</tool_call>", "\n", array=False)
ARRAY = CallLayout("arguments", "", "", "", array=True)
_DS = call_format("deepseek")
DEEPSEEK = CallLayout(
    "arguments", _DS.open, _DS.close, _DS.separator, False, _DS.call_head, _DS.call_tail
)


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(lambda: tokenizer, len(tokenizer))


def accepts(compiler: GrammarCompiler, tokenizer: Any, grammar: str, text: str) -> bool:
    """Whether `text`, then EOS, is a complete output of `grammar`."""
    g = RequestGrammar(compiler.compile(Constraint("ebnf", grammar)), [tokenizer.eos_token_id])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return all(g.accept(t) for t in ids) and g.accept(tokenizer.eos_token_id)


W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
N = '{"name": "now", "arguments": {}}'
DS_W = (
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Paris"}\n```<｜tool▁call▁end｜>'
)
DS_N = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{}\n```<｜tool▁call▁end｜>"
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


@pytest.mark.parametrize(
    ("layout", "parallel", "text", "ok"),
    [
        (HERMES, False, f"<tool_call>\n{W}\n</tool_call>", True),
        (HERMES, False, f"<tool_call>\n{N}\n</tool_call>", True),
        (HERMES, False, f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{N}\n</tool_call>", False),
        (HERMES, True, f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{N}\n</tool_call>", True),
        (HERMES, False, W, False),  # the tags are part of the format
        (
            HERMES,
            False,
            '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
            False,
        ),
        (HERMES, False, '<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>', False),
        (ARRAY, False, f"[{W}]", True),
        (ARRAY, False, f"[{W}, {N}]", False),
        (ARRAY, True, f"[{W}, {N}]", True),
        (ARRAY, True, "[]", False),
        (DEEPSEEK, False, f"{DS_BEGIN}{DS_W}{DS_END}", True),
        (DEEPSEEK, False, f"{DS_BEGIN}{DS_N}{DS_END}", True),
        (DEEPSEEK, False, f"{DS_BEGIN}{DS_W}\n{DS_N}{DS_END}", False),
        (DEEPSEEK, True, f"{DS_BEGIN}{DS_W}\n{DS_N}{DS_END}", True),
        (DEEPSEEK, False, f"{DS_BEGIN}{DS_W.replace('Paris', 'Paris, France')}{DS_END}", False),
        (DEEPSEEK, False, DS_W, False),  # the block's tags are part of the format
    ],
)
def test_forced_calls(
    compiler: GrammarCompiler,
    tokenizer: Any,
    layout: CallLayout,
    parallel: bool,
    text: str,
    ok: bool,
) -> None:
    grammar = forced_calls_grammar(FUNCTIONS, layout, parallel)
    assert accepts(compiler, tokenizer, grammar, text) is ok


def test_a_schema_that_cannot_be_enforced_is_refused() -> None:
    bad = FunctionSchema("f", {"type": "object", "not": {"required": ["x"]}})
    with pytest.raises(GrammarError, match="function 'f'"):
        forced_calls_grammar([bad], HERMES, parallel=False)


def test_deepseek_forced_calls_parse_back() -> None:
    """What the DeepSeek grammar writes is what its parser reads as calls."""
    text = f"{DS_BEGIN}{DS_W}\n{DS_N}{DS_END}"
    d = tool_call_parser("deepseek").parse(text)
    assert [(c.name, c.arguments) for c in d.calls] == [
        ("get_weather", '{"city": "Paris"}'),
        ("now", "{}"),
    ]
    assert d.content == ""


def test_forced_calls_travel_as_a_constraint_and_compile_on_the_pool(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    """A request carries the calls to force as a "tool_calls" constraint: the grammar is built
    by the compiler (on its threads), not where the request is made."""
    text = ForcedCalls(FUNCTIONS, HERMES, parallel=False).to_text()
    assert ForcedCalls.from_text(text) == ForcedCalls(FUNCTIONS, HERMES, False)
    compiled = compiler.submit(Constraint("tool_calls", text)).result()
    g = RequestGrammar(compiled, [tokenizer.eos_token_id])
    ids = tokenizer(f"<tool_call>\n{W}\n</tool_call>", add_special_tokens=False)["input_ids"]
    assert all(g.accept(t) for t in ids) and g.accept(tokenizer.eos_token_id)
    bad = FunctionSchema("f", {"type": "object", "not": {"required": ["x"]}})
    job = compiler.submit(Constraint("tool_calls", ForcedCalls([bad], HERMES, False).to_text()))
    with pytest.raises(GrammarError, match="function 'f'") as e:
        job.result()
    assert e.value.kind == "tools"
