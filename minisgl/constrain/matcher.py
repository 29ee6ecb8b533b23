"""Per-request grammar state: which tokens may come next, advanced by each accepted token; and
the masks of a step's constrained rows, filled in one call."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from minisgl.constrain.base import Backend, Matcher
from minisgl.constrain.grammar import Compiled

MAX_ROLLBACK = 64  # tokens `RequestGrammar.rollback` can take back (drafts of one step)
_WAITING, _MATCHED, _STOP = 0, 1, 2  # what each accepted token did (for rollback)


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask (bit j of word w allows token 32 * w + j)."""
    return -(-vocab_size // 32)


class RequestGrammar:
    """A grammar matcher over one request's output tokens.

    `stop_ids` are the request's own stop tokens (EOS unless ignore_eos, stop_token_ids): the
    grammar allows them only where it may end, so a constrained request stops with "stop" only
    once its output is complete. `end_ids` (EOS under ignore_eos) are allowed only where the
    grammar must end (nothing else may follow), and then end the request too.

    `start_after`: the grammar starts once this token has been accepted (a reasoning model's
    end of thinking); until then every token is allowed.

    Speculative decoding advances it through a request's drafts to build each position's mask
    and then takes them back (`rollback`): what each token accepted one at a time did is kept
    for that (tokens accepted in a batch, `MaskFiller.accept`, are not taken back).
    """

    def __init__(
        self,
        compiled: Compiled,
        stop_ids: Iterable[int],
        start_after: int | None = None,
        end_ids: Iterable[int] = (),
    ) -> None:
        self.backend = compiled.backend
        self.matcher: Matcher = compiled.backend.matcher(compiled.grammar)
        self.stop_ids = frozenset(stop_ids)
        self.end_ids = frozenset(end_ids) - self.stop_ids
        self.ends = self.stop_ids | self.end_ids
        # Whether the mask's end token must be made this request's stop tokens (`fix_row`):
        # always (stop tokens of its own), or only where the mask allows the end token.
        end = compiled.backend.end_token
        self.fix_always = bool(self.ends - {end})
        self.fix_at_end = not self.fix_always and self.stop_ids != {end}
        self._waiting_for = start_after
        self._start = start_after
        self.terminated = False  # a stop token was accepted: anything may follow
        self.failed = False  # a token accepted in a batch was refused (the request must end)
        self._trail: list[int] = []  # per token accepted one at a time: what it did

    @property
    def active(self) -> bool:
        """Whether the grammar constrains the next token (its start token has come)."""
        return self._waiting_for is None and not self.terminated

    def plain(self, token: int) -> bool:
        """Whether accepting `token` is the matcher's business alone (batched accepts)."""
        return self._waiting_for is None and not self.terminated and token not in self.ends

    def accept(self, token: int) -> bool:
        """Advance by `token`; False if the grammar does not allow it."""
        if self._waiting_for is not None:
            if token == self._waiting_for:
                self._waiting_for = None
            self._push(_WAITING)
            return True
        if self.terminated:
            return True
        if token in self.ends:
            if not self.matcher.accepting() or (
                token in self.end_ids and not self.matcher.stopped()
            ):
                return False
            self.terminated = True
            self._push(_STOP)
            return True
        if not self.matcher.accept(token):
            return False
        self._push(_MATCHED)
        return True

    def _push(self, what: int) -> None:
        self._trail.append(what)
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
        """Take back the last `n` tokens accepted one at a time (at most `MAX_ROLLBACK`)."""
        assert 0 <= n <= min(len(self._trail), MAX_ROLLBACK)
        if n == 0:
            return
        taken, self._trail = self._trail[-n:], self._trail[:-n]
        matched = taken.count(_MATCHED)
        if matched:
            self.matcher.rollback(matched)
        if _STOP in taken:
            self.terminated = False
        if _WAITING in taken:  # the earliest taken back were consumed while waiting
            self._waiting_for = self._start

    def fix_row(self, row: torch.Tensor) -> None:
        """Turn the backend's end token in `row` (a host mask row, just filled for the current
        state) into this request's stop and end tokens."""
        words = row.numpy().view(np.uint32)
        end = self.backend.end_token
        may_end = bool(words[end >> 5] >> (end & 31) & 1)
        must_end = may_end and bool(self.end_ids) and self.matcher.stopped()
        _set(words, end, False)
        for t in self.stop_ids:
            _set(words, t, may_end)
        for t in self.end_ids:
            _set(words, t, must_end)


def _set(words: np.ndarray, token: int, allowed: bool) -> None:
    if token >> 5 < len(words):
        bit = np.uint32(1 << (token & 31))
        words[token >> 5] = words[token >> 5] | bit if allowed else words[token >> 5] & ~bit


class MaskFiller:
    """Fills the token bitmask of a step's constrained rows in one call on the backend's own
    threads (`threads` of them, the GIL released), into reused host buffers (pinned when CUDA
    is present, so the copy to the device is asynchronous); accepts a step's tokens the same
    way.

    Two buffers alternate: a step's mask may still be copying to the device while the next
    step's is filled (under overlap the mask of step N + 2 is filled only after step N + 1's
    tokens arrived, so step N's copy has finished by then). Rows without a grammar hold
    whatever they held (the sampler never reads them: `TokenMask.rows`).
    """

    def __init__(self, vocab_size: int, threads: int) -> None:
        self.width = bitmask_width(vocab_size)
        self.threads = threads
        self._pools: dict[Backend, object] = {}
        self._buffers: list[torch.Tensor] = []
        self._turn = 0

    def _pool(self, g: RequestGrammar) -> object:
        pool = self._pools.get(g.backend)
        if pool is None:
            pool = self._pools[g.backend] = g.backend.pool(self.threads)
        return pool

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

    def fill(self, grammars: Sequence[RequestGrammar | None]) -> torch.Tensor:
        """[len(grammars), W] int32: row i the next tokens grammars[i] allows (all of them
        before it starts, and once it has terminated: its stop token came, anything will do);
        rows of None are not written."""
        bits = self.buffer(len(grammars))
        self.fill_into(bits, grammars)
        return bits

    def fill_into(self, bits: torch.Tensor, grammars: Sequence[RequestGrammar | None]) -> None:
        """`fill` into `bits` [len(grammars), W] from `buffer`."""
        live: list[tuple[RequestGrammar, int]] = []
        for i, g in enumerate(grammars):
            if g is None:
                continue
            if g.active and not g.failed:
                live.append((g, i))
            else:
                bits[i].fill_(-1)
        if not live:
            return
        g0 = live[0][0]
        if all(g.backend is g0.backend for g, _ in live):
            g0.backend.fill(self._pool(g0), bits, [(g.matcher, i) for g, i in live])
        else:
            for g, i in live:
                g.backend.fill(self._pool(g), bits, [(g.matcher, i)])
        fix = [(g, i) for g, i in live if g.fix_always]
        at_end = [(g, i) for g, i in live if g.fix_at_end]
        if at_end:  # one look at all their end-token bits
            end = at_end[0][0].backend.end_token
            words = bits[[i for _, i in at_end], end >> 5].tolist()
            fix += [gi for gi, w in zip(at_end, words) if w >> (end & 31) & 1]
        for g, i in fix:
            g.fix_row(bits[i])

    def accept(self, pairs: Sequence[tuple[RequestGrammar, int]]) -> None:
        """Advance each grammar by its token, in order (a step's tokens: the plain ones of
        distinct grammars in one call); a grammar that refuses its token is marked `failed`."""
        batch: list[tuple[RequestGrammar, int]] = []
        seen: set[int] = set()
        for g, t in pairs:
            if g.failed:
                continue
            if g.plain(t) and id(g) not in seen:
                batch.append((g, t))
                seen.add(id(g))
                continue
            self._accept_batch(batch)
            batch, seen = [], set()
            g.failed = not g.accept(t)
        self._accept_batch(batch)

    def _accept_batch(self, batch: list[tuple[RequestGrammar, int]]) -> None:
        if not batch:
            return
        g0 = batch[0][0]
        if all(g.backend is g0.backend for g, _ in batch):
            ok = g0.backend.accept(self._pool(g0), [(g.matcher, t) for g, t in batch])
        else:
            ok = [g.matcher.accept(t) for g, t in batch]
        for (g, _), good in zip(batch, ok, strict=True):
            g.failed = not good

    def fill_drafts(self, rows: Sequence[tuple[RequestGrammar | None, list[int]]]) -> torch.Tensor:
        """A verify step's mask: for each (grammar, drafts) row, len(drafts) + 1 mask rows, the
        allowed tokens at each position of the drafts (after the drafts before it; the grammar
        is advanced through them and taken back); rows of None are not written."""
        bits = self.buffer(sum(len(d) + 1 for _, d in rows))
        at = 0
        for g, drafts in rows:
            if g is not None:
                taken = 0
                for j in range(len(drafts) + 1):
                    self.fill_into(bits[at + j : at + j + 1], [g])
                    if j < len(drafts):
                        accepted = g.accept(drafts[j])
                        assert accepted, "drafts are cut to what the grammar allows"
                        taken += 1
                g.rollback(taken)
            at += len(drafts) + 1
        return bits
