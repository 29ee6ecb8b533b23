"""The masks a step's rows get (filled together on the backend's threads, the request's stop
tokens written in) equal a brute-force reference: every token of SmolLM2's real vocabulary
tried on its own against the grammar's parser (`validate_tokens`: the token's bytes run through
the lexer and parser, none of the token trie, slices or mask cache the mask comes from), at a
few hundred random states of several grammars reached by random walks."""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pytest
from structured_schemas import CASES

from minisgl.constrain import GrammarCompiler, MaskFiller, RequestGrammar
from minisgl.core import Constraint

VOCAB = 49152
EOS = 2
OTHER_STOP = 0  # a second stop token of one grammar: allowed exactly where EOS is
WALKERS, STEPS = 6, 10  # per grammar: 4 grammars x 60 states
SCHEMAS = {c.name: c.schema for c in CASES}
GRAMMARS = [
    Constraint("json_schema", json.dumps(SCHEMAS["person"])),
    Constraint("json_schema", json.dumps(SCHEMAS[CASES[10].name])),
    Constraint("regex", r"(\+\d{1,3} )?\(\d{3}\) \d{3}-\d{4}|[a-z]{2,6}@[a-z]{3,8}\.(com|org)"),
    Constraint("ebnf", 'root ::= item ("," " "? item)*\nitem ::= [a-z]+ | "(" root ")"'),
]


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(lambda: tokenizer, VOCAB, end_token=EOS)


def allowed(row: Any) -> set[int]:
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:VOCAB]
    return set(np.nonzero(bits)[0].tolist())


def reference(g: RequestGrammar, stops: list[int]) -> set[int]:
    """Every token the parser takes from here, one at a time; the stop tokens where the output
    is complete. Where the grammar forces text, the first of the tokens the tokenizer writes it
    in (llguidance's choice: no other spelling of forced text)."""
    m = g.matcher.m  # type: ignore[attr-defined]
    forced = m.compute_ff_tokens()
    if forced:  # text the grammar forces is written in the tokenizer's own tokens
        return {forced[0]}
    ok = {t for t in range(VOCAB) if t not in (EOS, OTHER_STOP) and m.validate_tokens([t]) == 1}
    return ok | set(stops) if g.matcher.accepting() else ok


@pytest.mark.parametrize("which", range(len(GRAMMARS)), ids=[c.kind for c in GRAMMARS])
def test_masks_equal_every_token_tried_alone(compiler: GrammarCompiler, which: int) -> None:
    compiled = compiler.compile(GRAMMARS[which])
    stops = [EOS, OTHER_STOP] if which % 2 else [EOS]  # the second: `fix_row` writes them
    walkers = [RequestGrammar(compiled, stops) for _ in range(WALKERS)]
    filler = MaskFiller(VOCAB, threads=2)
    rng = random.Random(which)
    checked = 0
    for _ in range(STEPS):
        live = [g for g in walkers if g.active]
        if not live:
            break
        bits = filler.fill(live)
        moves = []
        for i, g in enumerate(live):
            got = allowed(bits[i])
            assert got == reference(g, stops), (GRAMMARS[which], i)
            checked += 1
            words = [t for t in got if t not in stops]
            # Mostly continue; now and then end (a stop token is allowed there).
            end = not words or (got & set(stops) and rng.random() < 0.2)
            moves.append((g, EOS if end else rng.choice(sorted(words))))
        filler.accept(moves)
        assert not any(g.failed for g, _ in moves)
    assert checked >= WALKERS * 5
