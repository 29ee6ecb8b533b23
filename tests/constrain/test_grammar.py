"""Grammars compiled against the real SmolLM2 vocabulary: what they allow token by token, the
errors a bad one gives, and the cache."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisgl.constrain import GrammarCompiler, GrammarError, MaskFiller, RequestGrammar
from minisgl.core import Constraint, InvalidRequestError

VOCAB = 49152
EOS = 2  # SmolLM2's <|im_end|>

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(lambda: tokenizer, VOCAB, end_token=EOS)


def fill_bitmask(grammars: list[RequestGrammar | None]) -> torch.Tensor:
    return MaskFiller(VOCAB, threads=2).fill(grammars).clone()


def allowed(grammar: RequestGrammar) -> set[int]:
    bits = fill_bitmask([grammar])[0]
    words = bits.tolist()
    return {32 * w + j for w, word in enumerate(words) for j in range(32) if word >> j & 1}


def walk(tokenizer: Any, grammar: RequestGrammar, text: str) -> None:
    """Feed `text`'s tokens one by one, checking each is among the allowed ones first."""
    for t in tokenizer(text, add_special_tokens=False)["input_ids"]:
        assert t in allowed(grammar), (text, tokenizer.decode([t]))
        assert grammar.accept(t)


def test_json_schema_allows_valid_output_and_eos_only_at_the_end(compiler, tokenizer) -> None:
    c = Constraint("json_schema", json.dumps(PERSON))
    g = RequestGrammar(compiler.compile(c), [EOS])
    text = '{"name": "Ada", "age": 36}'
    jsonschema.validate(json.loads(text), PERSON)
    assert EOS not in allowed(g)
    walk(tokenizer, g, text[:-1])
    assert EOS not in allowed(g)  # the object is not closed yet
    walk(tokenizer, g, "}")
    assert allowed(g) >= {EOS}
    assert g.accept(EOS) and g.terminated


def test_json_schema_refuses_what_the_schema_forbids(compiler, tokenizer) -> None:
    g = RequestGrammar(compiler.compile(Constraint("json_schema", json.dumps(PERSON))), [EOS])
    walk(tokenizer, g, '{"name": "Ada", "age": ')
    minus = tokenizer("-", add_special_tokens=False)["input_ids"][0]
    assert minus not in allowed(g)  # minimum 0
    assert not g.accept(minus)


def test_regex_and_ebnf(compiler, tokenizer) -> None:
    date = RequestGrammar(compiler.compile(Constraint("regex", r"\d{4}-\d{2}-\d{2}")), [EOS])
    walk(tokenizer, date, "2024-01-31")
    assert allowed(date) == {EOS}
    expr = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= [0-9]+ | "(" expr ")"
"""
    g = RequestGrammar(compiler.compile(Constraint("ebnf", expr)), [EOS])
    walk(tokenizer, g, "(1+2)-30")
    assert EOS in allowed(g)
    paren = tokenizer(")", add_special_tokens=False)["input_ids"][0]
    assert paren not in allowed(g)  # no open parenthesis left


@pytest.mark.parametrize(
    "kind, text, reason",
    [
        ("json_schema", '{"type": "objectx"}', "objectx"),
        ("regex", "([a-z", "Unclosed"),
        ("ebnf", 'root ::= "a" | foo', "foo"),
    ],
)
def test_bad_grammars_name_the_field_and_the_reason(compiler, kind, text, reason) -> None:
    with pytest.raises(GrammarError, match=f"^{kind}: .*{reason}") as e:
        compiler.compile(Constraint(kind, text))
    assert ".cc" not in str(e.value)  # no C++ source location
    with pytest.raises(GrammarError):  # the same through the pool
        compiler.submit(Constraint(kind, text)).result()


def test_constraint_shape_is_checked_before_compiling() -> None:
    with pytest.raises(InvalidRequestError, match="json_schema: not valid JSON"):
        Constraint("json_schema", "{'type': 'object'}")
    with pytest.raises(InvalidRequestError, match="regex: must be a non-empty string"):
        Constraint("regex", "")
    with pytest.raises(InvalidRequestError, match="unknown kind"):
        Constraint("lark", "start: x")


def test_repeats_are_cache_hits(tokenizer) -> None:
    compiler = GrammarCompiler(lambda: tokenizer, VOCAB, end_token=EOS)
    c = Constraint("regex", "[ab]{3}")
    first = compiler.submit(c).result()
    again = compiler.compile(c)
    assert compiler.stats.compiled == 1 and compiler.stats.hits == 1
    g1, g2 = RequestGrammar(first, [EOS]), RequestGrammar(again, [EOS])
    assert torch.equal(fill_bitmask([g1]), fill_bitmask([g2]))


def test_batched_fill_equals_each_row_alone(compiler, tokenizer) -> None:
    """Rows filled together on the batch matcher's threads equal each grammar's own mask,
    whatever state each is in; a terminated grammar allows everything; rows without a grammar
    are left alone; the two alternating buffers do not mix steps."""
    person = Constraint("json_schema", json.dumps(PERSON))
    texts = ['{"name": "Ad', '{"name": "Ada", "age": 3', "", '{"name": "Ada", "age": 36}']
    grammars = []
    for text in texts:
        g = RequestGrammar(compiler.compile(person), [EOS])
        for t in tokenizer(text, add_special_tokens=False)["input_ids"]:
            assert g.accept(t)
        grammars.append(g)
    assert grammars[3].accept(EOS) and grammars[3].terminated
    date = RequestGrammar(compiler.compile(Constraint("regex", r"\d{4}-\d{2}")), [EOS])
    rows: list[RequestGrammar | None] = [grammars[0], None, date, grammars[1], grammars[2]]
    alone = [None if g is None else allowed(g) for g in rows]
    filler = MaskFiller(VOCAB, threads=2)
    filler.fill([None] * 5)[:].fill_(7)  # the first buffer of the pair, scribbled over
    filler.fill(rows)  # the second
    bits = filler.fill(rows)  # the first again
    for i, want in enumerate(alone):
        words = bits[i].tolist()
        if want is None:
            assert words == [7] * len(words)  # not written
            continue
        assert {32 * w + j for w, x in enumerate(words) for j in range(32) if x >> j & 1} == want
    assert bool((filler.fill([grammars[3]])[0] == -1).all())


_PIECES = list('ab01()[]{}|*+?.^$\\-:=" ,;#<>/!&~') + ["::=", "root", "\\d", "\\p{L}", "(?="]
_PIECES += ["(?<n>", "{2,1}", "{99999}", "[^", "\\", "\n"]
TEXTS = st.lists(st.sampled_from(_PIECES), max_size=25).map("".join) | st.text(max_size=30)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(["regex", "ebnf"]), text=TEXTS)
def test_random_regexes_and_grammars_compile_or_give_a_grammar_error(compiler, kind, text) -> None:
    """Whatever a client sends: a GrammarError or a grammar, never another error (a 500) or a
    crash of the process that compiles it."""
    if kind == "ebnf" and not text.startswith("root"):
        text = "root ::= " + text
    try:
        constraint = Constraint(kind, text)
    except InvalidRequestError:
        return  # blank: refused before compiling
    with contextlib.suppress(GrammarError):
        compiler.compile(constraint)


def test_drafts_are_cut_where_the_grammar_refuses_and_taken_back(compiler, tokenizer) -> None:
    """Speculative decoding's use: the grammar advanced through drafts gives each position's
    mask (each equal to the mask after accepting the drafts before it for real) and is then
    rolled back to where it was, also across the start token of a reasoning model."""
    ids = tokenizer.encode('{"name": "Ann", "age": 7}', add_special_tokens=False)
    person = compiler.compile(Constraint("json_schema", json.dumps(PERSON)))
    g = RequestGrammar(person, [EOS])
    before = fill_bitmask([g])
    assert g.accept_prefix([*ids[:3], ids[0], *ids[3:]]) == 3  # a second "{" is refused
    g.rollback(3)
    assert torch.equal(fill_bitmask([g]), before)
    filler = MaskFiller(VOCAB, threads=2)
    rows = filler.fill_drafts([(g, ids[:4]), (None, [5, 6])]).clone()
    assert rows.shape[0] == 5 + 3 and torch.equal(fill_bitmask([g]), before)
    for j in range(5):  # row j: the mask after the first j drafts, accepted for real
        ref = RequestGrammar(person, [EOS])
        assert ref.accept_prefix(ids[:j]) == j
        assert torch.equal(rows[j], fill_bitmask([ref])[0])
    # Before the start token everything is allowed; taking it back makes the grammar wait again.
    think_end = ids[-1]
    g = RequestGrammar(person, [EOS], start_after=think_end)
    assert g.accept_prefix([7, think_end, *ids[:2]]) == 4 and g.active
    g.rollback(3)
    assert not g.active and g.accept(think_end) and g.accept_prefix(ids) == len(ids)
