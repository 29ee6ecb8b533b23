"""The scheduler's side of speculative decoding, whole: which decoding requests verify drafts in
a step and how many (their limits, the policy's back-off, the pages there are), the host drafts
(n-gram) cut by the request's grammar, and what each verify step kept."""

from __future__ import annotations

from collections.abc import Callable

from minisgl.config import EngineConfig
from minisgl.core import Req, pages_for
from minisgl.spec.base import DraftRow
from minisgl.spec.ngram import NgramProposer
from minisgl.spec.policy import SpecPolicy, SpecStats


class DraftPlanner:
    """Plans the drafts of each step for the scheduler (`minisgl.scheduler.Scheduler`).

    Host drafts (n-gram) are made here and written into the plan's token writes; device drafts
    (the layer-skip draft or a draft model) are made by the engine, which is told only their
    lengths. Constrained requests speculate with host drafts only: their grammar is advanced
    through the drafts to build each position's mask, and a device draft's tokens are not on
    the host.
    """

    def __init__(self, config: EngineConfig, page_size: int, max_context: int) -> None:
        self.policy = SpecPolicy(config.speculative_num_draft_tokens, config.speculative_max_batch)
        self.ngram: NgramProposer | None = None
        if config.speculative_algorithm == "ngram":
            self.ngram = NgramProposer(config.speculative_ngram_n, config.speculative_ngram_min_n)
        self.page_size, self.max_context = page_size, max_context
        self._expected: set[str] = set()  # see `expects_drafts`
        self._ids: dict[str, list[int]] = {}  # the last plan's host drafts, by request

    @property
    def stats(self) -> SpecStats:
        return self.policy.stats

    def _may_draft(self, r: Req) -> bool:
        return r.params.constraint is None or self.ngram is not None

    def _limit(self, r: Req) -> int:
        """Drafts `r` may verify now: within max_tokens and the context (the step's own token
        comes on top), 0 when it should not speculate."""
        if not self._may_draft(r) or len(r.output_ids) != r.num_sampled:
            return 0  # tokens still in flight
        room = min(r.params.max_tokens - r.num_sampled, self.max_context - r.seq_len) - 1
        return max(0, min(self.policy.k, room))

    def expects_drafts(self, ready: list[Req]) -> bool:
        """Whether some of the requests `ready` to decode would verify drafts next if all their
        tokens were on the host (the overlap loop then finishes the step in flight first). A
        request that then has no draft after all (the token that was in flight ended its
        match) cost that wait for nothing: the next plan counts it as a miss."""
        if len(ready) > self.policy.max_batch:
            return False
        ok = [r for r in ready if self.policy.allows(r.rid) and self._may_draft(r)]
        if self.ngram is not None:  # a device draft always proposes
            ok = [r for r in ok if self.ngram.hit(r.rid, r.prompt_ids, r.output_ids)]
        self._expected = {r.rid for r in ok}
        return bool(ok)

    def plan(
        self,
        decode: list[Req],
        room: int,
        tokens_in_flight: bool,
        valid: Callable[[Req, list[int]], list[int]],
        write: Callable[[Req, int, list[int]], None],
    ) -> tuple[list[int], int]:
        """Drafts per decoding request (0: a plain decode) within `room` free pages (none while
        `tokens_in_flight`: drafts wait for the host). Host drafts are cut by `valid` (the
        longest prefix the request's grammar allows: a draft it refuses could never be
        accepted) and queued into the request's token row with `write`. Returns the drafts and
        the room left."""
        drafts = [0] * len(decode)
        self._ids = {}
        chosen = self.policy.select([r.rid for r in decode])
        if tokens_in_flight:
            return drafts, room
        want = [(i, r, self._limit(r)) for i, r in enumerate(decode) if r.rid in chosen]
        want = [(i, r, k) for i, r, k in want if k]
        if self.ngram is None:  # device drafts: lengths only (the engine drafts)
            proposed = [[0] * k for _, _, k in want]
        else:
            rows = [  # (running requests hold a slot)
                DraftRow(r.prompt_ids, r.output_ids, r.slot, k, r.seq_len, r.rid)  # type: ignore[arg-type]
                for _, r, k in want
            ]
            proposed = [valid(r, p) for (_, r, _), p in zip(want, self.ngram.propose(rows))]
        expected, self._expected = self._expected, set()
        for (i, r, _), ids in zip(want, proposed):
            if not ids and r.rid in expected:
                self.policy.missed(r.rid)
            need = pages_for(r.seq_len + len(ids), self.page_size)
            extra = need - max(len(r.pages), pages_for(r.seq_len, self.page_size))
            if not ids or extra > room:
                continue
            room -= max(0, extra)
            drafts[i] = len(ids)
            if self.ngram is not None:
                write(r, r.seq_len, ids)
                self._ids[r.rid] = ids
        return drafts, room

    def host_drafts(self, reqs: list[Req], lens: list[int]) -> list[list[int]]:
        """The drafts of the last plan's rows `reqs` of `lens` drafts each, for their grammar
        masks (a device draft's rows are unconstrained: their ids are never read)."""
        return [self._ids.get(r.rid, [0] * d) for r, d in zip(reqs, lens)]

    def verified(self, req: Req, prefix: int, proposed: int, count: int) -> None:
        """A verify row of `req` (its last token at `prefix`) checked `proposed` drafts and
        kept `count` tokens: its record follows, and its lengths unless it finished (the
        scheduler gives back the pages of the rejected drafts)."""
        self.policy.record(req.rid, proposed, count - 1)
        if not req.finished:
            req.num_sampled += count - 1
            req.num_computed = req.num_stored = prefix + count

    def drop(self, rid: str) -> None:
        self.policy.drop(rid)
        if self.ngram is not None:
            self.ngram.drop(rid)
