"""Per-request grammar state: which tokens may come next, advanced by each accepted token."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

MAX_ROLLBACK = 64  # tokens `RequestGrammar.rollback` can take back (drafts of one step)


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask (bit j of word w allows token 32 * w + j)."""
    return -(-vocab_size // 32)


class RequestGrammar:
    """An xgrammar matcher over one request's output tokens.

    `stop_ids` are the request's own stop tokens (EOS unless ignore_eos, stop_token_ids): the
    grammar allows them only where it may end, so a constrained request stops with "stop" only
    once its output is complete.

    `start_after`: the grammar starts once this token has been accepted (a reasoning model's
    end of thinking); until then every token is allowed.

    Speculative decoding advances it through a request's drafts to build each position's mask
    and then takes them back (`rollback`): what each accepted token did is kept for that.
    """

    def __init__(self, compiled: Any, stop_ids: list[int], start_after: int | None = None) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_ids or None)
        self._waiting_for = start_after
        self._start = start_after
        self._trail: list[bool] = []  # per accepted token: the matcher took it (not waiting)

    @property
    def active(self) -> bool:
        """Whether the grammar constrains the next token (its start token has come)."""
        return self._waiting_for is None

    def accept(self, token: int) -> bool:
        """Advance by `token`; False if the grammar does not allow it (then nothing changes)."""
        if self._waiting_for is not None:
            if token == self._waiting_for:
                self._waiting_for = None
            self._push(False)
            return True
        ok: bool = self._matcher.accept_token(token)
        if ok:
            self._push(True)
        return ok

    def _push(self, matched: bool) -> None:
        self._trail.append(matched)
        if len(self._trail) > 2 * MAX_ROLLBACK:
            del self._trail[:MAX_ROLLBACK]

    def accept_prefix(self, tokens: Sequence[int]) -> int:
        """Advance by the longest prefix of `tokens` the grammar allows; returns its length
        (take it back with `rollback`)."""
        for n, t in enumerate(tokens):
            if not self.accept(t):
                return n
        return len(tokens)

    def rollback(self, n: int) -> None:
        """Take back the last `n` accepted tokens (at most `MAX_ROLLBACK`)."""
        assert 0 <= n <= min(len(self._trail), MAX_ROLLBACK)
        if n == 0:
            return
        taken, self._trail = self._trail[-n:], self._trail[:-n]
        matched = sum(taken)
        if matched:
            self._matcher.rollback(matched)
        if matched < n:  # the earliest taken back were consumed while waiting for the start
            self._waiting_for = self._start

    @property
    def terminated(self) -> bool:
        done: bool = self._matcher.is_terminated()
        return done

    @property
    def matcher(self) -> Any:
        """The xgrammar matcher (for batched filling)."""
        return self._matcher


class MaskFiller:
    """Fills the token bitmask of a step's constrained rows: several rows at once on xgrammar's
    batch matcher (`threads` C++ threads, the GIL released), into reused host buffers (pinned
    when CUDA is present, so the copy to the device is asynchronous).

    Two buffers alternate: a step's mask may still be copying to the device while the next
    step's is filled (under overlap the mask of step N + 2 is filled only after step N + 1's
    tokens arrived, so step N's copy has finished by then). Rows without a grammar hold
    whatever they held (the sampler never reads them: `TokenMask.rows`).
    """

    def __init__(self, vocab_size: int, threads: int) -> None:
        import xgrammar as xgr

        self.width = bitmask_width(vocab_size)
        self.threads = threads
        self._batch = xgr.BatchGrammarMatcher(max_threads=threads)
        self._buffers: list[torch.Tensor] = []
        self._turn = 0

    def buffer(self, rows: int) -> torch.Tensor:
        """The next of the two host buffers, [rows, W] (for `fill_into`, maybe on a thread)."""
        self._turn ^= 1
        if len(self._buffers) < 2 or self._buffers[self._turn].shape[0] < rows:
            cap = max(rows, 2 * self._buffers[0].shape[0] if self._buffers else 64)
            pin = torch.cuda.is_available()
            self._buffers = [
                torch.full((cap, self.width), -1, dtype=torch.int32, pin_memory=pin)
                for _ in range(2)
            ]
        return self._buffers[self._turn][:rows]

    def fill(self, grammars: list[RequestGrammar | None]) -> torch.Tensor:
        """[len(grammars), W] int32: row i the next tokens grammars[i] allows (all of them
        before it starts, and once it has terminated: its stop token came, anything will do);
        rows of None are not written."""
        bits = self.buffer(len(grammars))
        self.fill_into(bits, grammars)
        return bits

    def fill_into(self, bits: torch.Tensor, grammars: list[RequestGrammar | None]) -> None:
        """`fill` into `bits` [len(grammars), W] from `buffer`."""
        live, rows = [], []
        for i, g in enumerate(grammars):
            if g is None:
                continue
            if g.terminated or not g.active:
                bits[i].fill_(-1)
            else:
                live.append(g.matcher)
                rows.append(i)
        if len(live) == 1:  # no thread hand-off for a single row
            live[0].fill_next_token_bitmask(bits, rows[0])
        elif live:
            self._batch.batch_fill_next_token_bitmask(live, bits, rows)

    def fill_drafts(self, rows: list[tuple[RequestGrammar | None, list[int]]]) -> torch.Tensor:
        """A verify step's mask: for each (grammar, drafts) row, len(drafts) + 1 mask rows, the
        allowed tokens at each position of the drafts (after the drafts before it; the grammar
        is advanced through them and taken back); rows of None are not written."""
        bits = self.buffer(sum(len(d) + 1 for _, d in rows))
        at = 0
        for g, drafts in rows:
            if g is not None:
                taken = 0
                for j in range(len(drafts) + 1):
                    if g.terminated or not g.active:
                        bits[at + j].fill_(-1)
                    else:
                        g.matcher.fill_next_token_bitmask(bits, at + j)
                    if j < len(drafts):
                        accepted = g.accept(drafts[j])
                        assert accepted, "drafts are cut to what the grammar allows"
                        taken += 1
                g.rollback(taken)
            at += len(drafts) + 1
        return bits
