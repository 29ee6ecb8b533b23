"""Grammars compiled for one model's vocabulary: JSON schema, regex, EBNF (xgrammar).

Compiling costs from under a millisecond to a second, so it never runs on a serving loop:
`GrammarCompiler.submit` compiles on a small thread pool (xgrammar's C++ releases the GIL) and
caches the result by the grammar's text (LRU, bounded in bytes, xgrammar's own cache). The
tokenizer is loaded on the pool's first job too, so a process that never sees a constraint
never pays for it.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from minisgl.constrain.schema import check_enforceable
from minisgl.core import Constraint, InvalidRequestError

# Whitespace the JSON grammars allow between tokens: enough for pretty-printed nesting, not
# so much that a model can idle in blanks until max_tokens.
JSON_MAX_WHITESPACE = 8
CACHE_BYTES = 256 << 20
# Grammars remembered as compiled before, to count cache hits (their texts only; xgrammar's
# cache, bounded in bytes, holds the compiled ones).
KNOWN_GRAMMARS = 4096
_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class GrammarError(InvalidRequestError):
    """A schema, regex or grammar that cannot be compiled or enforced; the message is
    "{kind}: {reason}"."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"{kind}: {reason}")
        self.kind = kind
        self.reason = reason


@dataclass
class CompileStats:
    compiled: int = 0  # grammars compiled (cache misses)
    hits: int = 0  # served from the cache
    seconds: float = 0.0  # time spent compiling


class GrammarCompiler:
    """Compiles constraints against a tokenizer's vocabulary (padded to `vocab_size`)."""

    def __init__(
        self,
        load_tokenizer: Callable[[], Any],
        vocab_size: int,
        stop_ids: list[int] | None = None,
        threads: int = 2,
    ) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._stop_ids = stop_ids
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="minisgl-grammar")
        self._lock = threading.Lock()
        self._xgr: Any = None
        self._info: Any = None
        self._known: OrderedDict[Constraint, None] = OrderedDict()  # a repeat is a cache hit
        self.stats = CompileStats()

    def submit(self, constraint: Constraint) -> Future[Any]:
        """Compile on the pool; the future raises GrammarError for a bad grammar."""
        return self._pool.submit(self.compile, constraint)

    def compile(self, constraint: Constraint) -> Any:
        """The xgrammar CompiledGrammar of `constraint` (blocks; raises GrammarError)."""
        compiler = self._compiler()
        start = time.perf_counter()
        try:
            compiled = _compile(compiler, constraint)
        except GrammarError:
            raise
        except (RuntimeError, ValueError) as e:
            raise GrammarError(constraint.kind, _reason(e)) from None
        with self._lock:
            if constraint in self._known:
                self.stats.hits += 1
                self._known.move_to_end(constraint)
            else:
                self._known[constraint] = None
                if len(self._known) > KNOWN_GRAMMARS:
                    self._known.popitem(last=False)
                self.stats.compiled += 1
                self.stats.seconds += time.perf_counter() - start
        return compiled

    def tokenizer_info(self) -> Any:
        """The xgrammar TokenizerInfo the grammars are compiled against."""
        self._compiler()
        return self._info

    def _compiler(self) -> Any:
        with self._lock:
            if self._xgr is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self._load_tokenizer(),
                    vocab_size=self.vocab_size,
                    stop_token_ids=self._stop_ids,
                )
                self._info = info
                self._xgr = xgr.GrammarCompiler(
                    info, max_threads=1, cache_enabled=True, cache_limit_bytes=CACHE_BYTES
                )
            return self._xgr

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _compile(compiler: Any, c: Constraint) -> Any:
    if c.kind == "json_schema":
        schema = json.loads(c.text)  # already checked to be JSON
        check_enforceable(schema)
        return compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=True, max_whitespace_cnt=JSON_MAX_WHITESPACE
        )
    if c.kind == "regex":
        return compiler.compile_regex(c.text)
    if c.kind == "ebnf":
        return compiler.compile_grammar(c.text)
    if c.kind == "tool_calls":
        from minisgl.constrain.tools import ForcedCalls

        return compiler.compile_grammar(ForcedCalls.from_text(c.text).grammar())
    raise AssertionError(c.kind)


def _reason(e: Exception) -> str:
    """xgrammar's message without its "[time] source.cc:line:" prefix."""
    return _PREFIX.sub("", str(e).strip())
