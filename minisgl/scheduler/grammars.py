"""The scheduler's constrained requests: compile jobs, readiness, matchers and each step's
token mask.

A constrained request waits in the queue until its grammar has compiled (later requests may
be admitted before it); compiling runs on `GrammarCompiler`'s pool, never on the loop. With
tensor parallelism rank 0 decides when a grammar is ready (`poll`) and every rank marks it at
the same step (`mark_ready`), so all ranks admit the same requests.

The loop only notes a step's tokens (`accept`); the fill job of the next step's mask, on a
worker thread, accepts them all in one call and then fills all rows in one call. The loop waits
for a fill only where it must: the sampler's wait for the mask (on the device stream under
CUDA), and the matchers' use on the loop (speculative drafts, shutdown).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from minisgl.constrain import (
    CompileStats,
    GrammarCompiler,
    GrammarError,
    MaskFiller,
    RequestGrammar,
)
from minisgl.core import Req
from minisgl.engine.host_flag import HostFlag
from minisgl.engine.step import TokenMask

logger = logging.getLogger(__name__)


def fill_threads(ranks: int = 1) -> int:
    """Threads filling a step's masks: all but two of this process's share of the cores it may
    run on (`ranks`: tensor-parallel ranks on this host, each filling the same masks; the loop
    runs beside the fill, and the device's launches), at most 16."""
    return max(1, min(16, len(os.sched_getaffinity(0)) // max(1, ranks) - 2))


class Grammars:
    """Grammar state of every constrained request of one scheduler, keyed by request id."""

    def __init__(
        self, load_tokenizer: Callable[[], Any], vocab_size: int, ranks_per_node: int = 1
    ) -> None:
        self.load_tokenizer = load_tokenizer  # called on the first constraint
        self.vocab_size = vocab_size
        self._compiler: GrammarCompiler | None = None
        self._jobs: dict[str, Future[Any]] = {}  # compiling
        self._compiled: dict[str, Any] = {}  # ready, not admitted yet
        self._failed: dict[str, str] = {}  # the compile's error, for the request's answer
        self._matchers: dict[str, RequestGrammar] = {}  # admitted (kept through retraction)
        self._accepted: list[tuple[RequestGrammar, int]] = []  # tokens noted, not yet accepted
        self._filler: MaskFiller | None = None  # made with the first mask
        self.threads = fill_threads(ranks_per_node)  # of the filler (set before the first mask)
        # A step's tokens are accepted and its mask filled on this thread (in the backend's
        # threads, the GIL released), one job after another (started with the first mask)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="mask-fill")
        self._error: BaseException | None = None  # of a fill, raised on the loop
        self._flag = HostFlag()  # raised to the number of each fill when it is complete
        self._fills = 0
        self.fill_seconds = 0.0  # on the worker, all fills so far (read once they settled)
        self.num_constrained = 0  # constrained requests added so far

    @property
    def stats(self) -> CompileStats:
        """Compiles so far (none before the first constraint: no compiler then)."""
        return self._compiler.stats if self._compiler is not None else CompileStats()

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(self.load_tokenizer, self.vocab_size)
        return self._compiler

    def use_backend(self, backend: str) -> None:
        """Compile new grammars with `backend` (one of `minisgl.constrain.grammar.BACKENDS`)
        from now on (a benchmark's comparison; no request may be in flight)."""
        assert not (self._jobs or self._compiled or self._matchers)
        self._compiler = GrammarCompiler(self.load_tokenizer, self.vocab_size, backend=backend)
        self._filler = None

    def add(self, req: Req) -> None:
        constraint = req.params.constraint
        if constraint is not None:
            self._jobs[req.rid] = self.compiler.submit(constraint)
            self.num_constrained += 1

    def poll(self) -> list[str]:
        """Requests whose compile has finished since the last call (rank 0 asks)."""
        return [rid for rid, job in self._jobs.items() if job.done()]

    def mark_ready(self, rid: str) -> None:
        """The request may be admitted from now on (blocks until its compile is done: on rank
        0 it is; another rank's compile of the same grammar has had the same head start)."""
        job = self._jobs.pop(rid, None)
        if job is None:  # aborted meanwhile
            return
        try:
            self._compiled[rid] = job.result()
        except GrammarError as e:
            self._failed[rid] = str(e)

    def wait(self, timeout: float) -> None:
        """Sleep until a compile finishes or `timeout` seconds pass (a loop with nothing else to
        do)."""
        if self._jobs:
            futures.wait(list(self._jobs.values()), timeout, futures.FIRST_COMPLETED)

    def is_ready(self, req: Req) -> bool:
        return req.rid not in self._jobs

    def failure(self, req: Req) -> str | None:
        """Why the request's grammar could not be compiled (then it must be refused)."""
        return self._failed.pop(req.rid, None)

    def admit(self, req: Req) -> None:
        compiled = self._compiled.pop(req.rid, None)
        if compiled is not None:  # a retracted request keeps the matcher it has
            start = req.params.grammar_after_token
            # Under ignore_eos, EOS is among the stop ids only to end a complete grammar.
            ends = req.stop_ids - set(req.params.stop_token_ids) if req.params.ignore_eos else ()
            stops = req.stop_ids - set(ends)
            self._matchers[req.rid] = RequestGrammar(compiled, stops, start, ends)

    def accept(self, req: Req, token: int) -> bool:
        """Note `token` for the request's matcher (accepted with the step's others before the
        next mask); False once the matcher has refused a token noted before (the masks allowed
        it: a bug of ours)."""
        m = self._matchers.get(req.rid)
        if m is None:
            return True
        self._accepted.append((m, token))
        return not m.failed

    def _accept_noted(self) -> None:
        """Accept the noted tokens now, on this thread (after `_settle`)."""
        if self._accepted:
            self._get_filler().accept(self._accepted)
            self._accepted = []

    def drop(self, rid: str) -> None:
        # (a fill in progress keeps the matchers it was given)
        for table in (self._jobs, self._compiled, self._failed, self._matchers):
            table.pop(rid, None)  # type: ignore[attr-defined]

    def constrained(self, reqs: list[Req]) -> bool:
        return bool(self._matchers) and any(r.rid in self._matchers for r in reqs)

    def valid_drafts(self, req: Req, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the request's grammar allows (all of them without
        one): a draft it refuses could never be accepted."""
        m = self._matchers.get(req.rid)
        if m is None:
            return drafts
        self._settle()
        self._accept_noted()
        n = m.accept_prefix(drafts)
        m.rollback(n)
        return drafts[:n]

    def _get_filler(self) -> MaskFiller:
        if self._filler is None:
            self._filler = MaskFiller(self.vocab_size, self.threads)
        return self._filler

    def _fill_async(self, matchers: list[RequestGrammar | None], rows: list[int]) -> TokenMask:
        """A mask filled on the worker thread while the loop goes on (the step's noted tokens
        accepted first): the sampler waits for its flag (on the device stream under CUDA), and
        every use of a matcher on the loop waits for the job first (`_settle`)."""
        filler = self._get_filler()
        bits = filler.buffer(len(matchers))
        accepted, self._accepted = self._accepted, []
        self._fills += 1
        value = self._fills

        def fill() -> None:
            start = time.perf_counter()
            try:
                filler.accept(accepted)
                with torch.inference_mode():  # the buffers were made in the step's (a thread's)
                    filler.fill_into(bits, matchers)
            except BaseException as e:
                self._error = e
            finally:  # the stream waits for the flag: raise it whatever happened
                self._flag.raise_to(value)
                self.fill_seconds += time.perf_counter() - start

        self._worker.submit(fill)
        return TokenMask(bits, rows, (self._flag, value))

    def _settle(self) -> None:
        """Wait for the fills queued so far (they read the matchers); a failed one's error is
        raised here."""
        self._flag.host_wait(self._fills)
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def mask(self, reqs: list[Req], drafts: list[list[int]] | None = None) -> TokenMask:
        """The allowed next tokens of the constrained ones among `reqs` (the rows of a step
        that sample, in order), from their matchers' current state. A verify step (`drafts`
        per request, each cut by `valid_drafts`) has len(drafts) + 1 mask rows per request:
        one per scored position."""
        self._raise_failure()
        matchers = [self._matchers.get(r.rid) for r in reqs]
        if drafts is None:  # queued behind the fill in progress, if any
            rows = [i for i, m in enumerate(matchers) if m is not None]
            return self._fill_async(matchers, rows)
        self._settle()
        self._accept_noted()
        rows, at = [], 0
        for m, d in zip(matchers, drafts, strict=True):
            if m is not None:
                rows.extend(range(at, at + len(d) + 1))
            at += len(d) + 1
        return TokenMask(self._get_filler().fill_drafts(list(zip(matchers, drafts))), rows)

    def close(self) -> None:
        self._settle()
        self._worker.shutdown()
        if self._compiler is not None:
            self._compiler.close()
