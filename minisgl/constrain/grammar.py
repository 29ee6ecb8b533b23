"""Grammars compiled for one model's vocabulary: JSON schema, regex, EBNF, forced tool calls.

Compiling against the vocabulary costs milliseconds (up to a second for a large schema), so it
never runs on a serving loop: `GrammarCompiler.submit` compiles on a small thread pool (the
backend releases the GIL) and caches the result by the constraint (LRU). `check` is the cheap
part alone (the grammar text, validated without the vocabulary): what the tokenizer worker
does, so that a grammar is compiled only in the scheduler. The backend, and the tokenizer with
it, is made on the pool's first job, so a process that never sees a constraint never pays.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

from minisgl.constrain.base import Backend
from minisgl.core import Constraint

CACHE_ENTRIES = 512  # compiled grammars kept (a schema's is tens to hundreds of kilobytes)
# name -> (module of `minisgl.constrain`, class), imported on first use
BACKENDS = {"llguidance": ("llg", "LLGuidance"), "xgrammar": ("xgr", "XGrammar")}


class Compiled(NamedTuple):
    """A grammar compiled by `backend`."""

    backend: Backend
    grammar: Any


@dataclass
class CompileStats:
    compiled: int = 0  # grammars compiled (cache misses)
    hits: int = 0  # served from the cache
    seconds: float = 0.0  # time spent compiling


class GrammarCompiler:
    """Compiles constraints against a tokenizer's vocabulary (padded to `vocab_size`);
    `end_token` (default: the tokenizer's EOS) is what masks allow where a grammar may end."""

    def __init__(
        self,
        load_tokenizer: Callable[[], Any],
        vocab_size: int,
        end_token: int | None = None,
        threads: int = 2,
        backend: str = "llguidance",
    ) -> None:
        assert backend in BACKENDS, backend
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._end_token = end_token
        self._kind = backend
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="minisgl-grammar")
        self._lock = threading.Lock()
        self._backend: Backend | None = None
        self._cache: OrderedDict[Constraint, Compiled] = OrderedDict()
        self.stats = CompileStats()

    @property
    def backend(self) -> Backend:
        with self._lock:
            if self._backend is None:
                module, name = BACKENDS[self._kind]
                cls = getattr(importlib.import_module(f"minisgl.constrain.{module}"), name)
                self._backend = cls(self._load_tokenizer, self.vocab_size, self._end_token)
            return self._backend

    def submit(self, constraint: Constraint) -> Future[Compiled]:
        """Compile on the pool; the future raises GrammarError for a bad grammar."""
        return self._pool.submit(self.compile, constraint)

    def submit_check(self, constraint: Constraint) -> Future[str]:
        """`check` on the pool."""
        return self._pool.submit(self.check, constraint)

    def check(self, constraint: Constraint) -> str:
        """The grammar text, checked without the vocabulary (GrammarError): cheap, and all but
        a few grammars that fail to compile fail here."""
        return self.backend.source(constraint)

    def compile(self, constraint: Constraint) -> Compiled:
        """`constraint` compiled (blocks; raises GrammarError)."""
        with self._lock:
            cached = self._cache.get(constraint)
            if cached is not None:
                self._cache.move_to_end(constraint)
                self.stats.hits += 1
                return cached
        backend = self.backend
        start = time.perf_counter()
        compiled = Compiled(backend, backend.compile(backend.source(constraint), constraint.kind))
        with self._lock:
            self._cache[constraint] = compiled
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            self.stats.compiled += 1
            self.stats.seconds += time.perf_counter() - start
        return compiled

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
