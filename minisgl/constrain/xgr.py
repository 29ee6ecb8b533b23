"""The xgrammar backend, kept to compare against (`benchmark.structured`); not a dependency.

JSON schemas (compiled as they are, none of `prepare`'s checks), regexes and xgrammar's EBNF;
no forced tool calls. Its matchers are filled on xgrammar's batch matcher.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from minisgl.constrain.base import JSON_MAX_WHITESPACE, Backend, GrammarError, Matcher
from minisgl.core import Constraint


class XGrammarMatcher:
    __slots__ = ("m",)

    def __init__(self, m: Any) -> None:
        self.m = m

    def accept(self, token: int) -> bool:
        return bool(self.m.accept_token(token))

    def rollback(self, n: int) -> None:
        self.m.rollback(n)

    def accepting(self) -> bool:
        return bool(self.m.is_completed())

    def stopped(self) -> bool:
        return False  # xgrammar does not say (an `ignore_eos` request then never ends early)


class XGrammar(Backend):
    name = "xgrammar"

    def __init__(
        self, load_tokenizer: Callable[[], Any], vocab_size: int, end_token: int | None = None
    ) -> None:
        import xgrammar as xgr

        hf = load_tokenizer()
        self.end_token = hf.eos_token_id if end_token is None else end_token
        info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=[self.end_token]
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)

    def source(self, constraint: Constraint) -> str:
        if constraint.kind == "tool_calls":
            raise GrammarError("tool_calls", "not compiled by the xgrammar backend")
        return constraint.text

    def compile(self, source: str, kind: str) -> Any:
        try:
            if kind == "json_schema":
                return self._compiler.compile_json_schema(
                    source, any_whitespace=True, max_whitespace_cnt=JSON_MAX_WHITESPACE
                )
            if kind == "regex":
                return self._compiler.compile_regex(source)
            return self._compiler.compile_grammar(source)
        except (RuntimeError, ValueError) as e:
            raise GrammarError(kind, str(e)) from None

    def matcher(self, compiled: Any) -> Matcher:
        import xgrammar as xgr

        return XGrammarMatcher(xgr.GrammarMatcher(compiled))

    def pool(self, threads: int) -> Any:
        import xgrammar as xgr

        return xgr.BatchGrammarMatcher(max_threads=threads)

    def fill(self, pool: Any, bits: torch.Tensor, rows: Sequence[tuple[Matcher, int]]) -> None:
        if rows:
            matchers = [g.m for g, _ in rows]  # type: ignore[attr-defined]
            pool.batch_fill_next_token_bitmask(matchers, bits, [i for _, i in rows])

    def accept(self, pool: Any, pairs: Sequence[tuple[Matcher, int]]) -> list[bool]:
        return [g.accept(t) for g, t in pairs]
