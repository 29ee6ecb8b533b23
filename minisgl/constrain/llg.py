"""The llguidance backend: JSON schemas, regexes, GBNF/Lark grammars and forced tool calls.

A compiled grammar is an `LLMatcher` that is never advanced; each request's matcher is a copy
of it (tens of microseconds; the copies share what the lexer has learnt). A matcher keeps the
mask of the state it is in, so a row that stays in one state (inside a string) costs a copy.
A step's rows are filled, and its tokens accepted, in one call each on llguidance's own
threads with the GIL released.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from minisgl.constrain.base import Backend, GrammarError, Matcher
from minisgl.constrain.schema import UnenforceableSchema, json_grammar, short_reason
from minisgl.core import Constraint


class LLGuidanceMatcher:
    """A request's llguidance matcher (`m`) as a `Matcher`."""

    __slots__ = ("m",)

    def __init__(self, m: Any) -> None:
        self.m = m

    def accept(self, token: int) -> bool:
        # (a refused token leaves the matcher as it was; `consume_token` would spend it)
        return bool(self.m.try_consume_tokens([token]) == 1)

    def rollback(self, n: int) -> None:
        self.m.rollback(n)

    def accepting(self) -> bool:
        return bool(self.m.is_accepting())

    def stopped(self) -> bool:
        return bool(self.m.is_stopped())


class LLGuidance(Backend):
    name = "llguidance"

    def __init__(
        self, load_tokenizer: Callable[[], Any], vocab_size: int, end_token: int | None = None
    ) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._end_token = end_token
        self._lock = threading.Lock()
        self._tokenizer: Any = None

    @property
    def end_token(self) -> int:  # type: ignore[override]
        self.tokenizer()
        assert self._end_token is not None
        return self._end_token

    def tokenizer(self) -> Any:
        """llguidance's view of the vocabulary (made on first use: about a second)."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                hf = self._load_tokenizer()
                if self._end_token is None:
                    self._end_token = hf.eos_token_id
                self._tokenizer = llguidance.hf.from_tokenizer(
                    hf, n_vocab=self.vocab_size, eos_token=self._end_token
                )
            return self._tokenizer

    def source(self, constraint: Constraint) -> str:
        from llguidance import LLMatcher

        kind, text = constraint.kind, constraint.text
        try:
            if kind == "json_schema":
                grammar = json_grammar(json.loads(text))
            elif kind == "regex":
                grammar = LLMatcher.grammar_from_regex(text)
            elif kind == "ebnf":
                grammar = LLMatcher.grammar_from_lark(_lark(text))
            else:
                from minisgl.constrain.tools import ForcedCalls

                calls = ForcedCalls.from_text(text)
                grammar = LLMatcher.grammar_from_lark(calls.lark())
        except UnenforceableSchema as e:
            raise GrammarError(kind, str(e)) from None
        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
        if failed:
            raise GrammarError(kind, short_reason(messages[0]))
        return grammar

    def compile(self, source: str, kind: str) -> Any:
        from llguidance import LLMatcher

        m = LLMatcher(self.tokenizer(), source, log_level=0)
        if m.is_error():
            raise GrammarError(kind, short_reason(m.get_error()))
        return m

    def matcher(self, compiled: Any) -> Matcher:
        return LLGuidanceMatcher(compiled.deep_copy())

    def pool(self, threads: int) -> Any:
        from llguidance import LLExecutor

        return LLExecutor(threads)

    def fill(self, pool: Any, bits: torch.Tensor, rows: Sequence[tuple[Matcher, int]]) -> None:
        if not rows:
            return
        assert bits.is_contiguous() and bits.dtype == torch.int32
        pairs = [(g.m, i) for g, i in rows]  # type: ignore[attr-defined]
        width = bits.shape[1] * 4
        pool.unsafe_compute_mask_ptr(pairs, bits.data_ptr(), width, bits.shape[0])

    def accept(self, pool: Any, pairs: Sequence[tuple[Matcher, int]]) -> list[bool]:
        if not pairs:
            return []
        return list(pool.consume_token_par([(g.m, t) for g, t in pairs]))  # type: ignore[attr-defined]


def _lark(text: str) -> str:
    """A GBNF grammar (llama.cpp's, rules `name ::= ...` from `root`) as Lark; Lark as it is."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(text)
    except Exception as e:  # the converter raises plain Exceptions for bad grammars
        raise GrammarError("ebnf", str(e) or type(e).__name__) from None
