"""When to speculate: per-request acceptance tracking, and none for large batches."""

from __future__ import annotations

from dataclasses import dataclass, field

# A request whose verify steps kept fewer than this many drafts on average (an exponential
# average over about 1 / EMA_WEIGHT steps) stops speculating for a while: each verify step
# costs more than a decode step, so few accepted tokens would make it slower than decoding.
MIN_MEAN_ACCEPTED = 0.7
EMA_WEIGHT = 0.25
BACKOFF_STEPS = 32  # plain decode steps before a request that stopped tries again,
MAX_BACKOFF_DOUBLINGS = 3  # doubled after each failed try in a row (32, 64, 128, 256)
PROBATION_STEPS = 2  # verify steps before its average is trusted


@dataclass
class _ReqSpec:
    mean_accepted: float = 0.0
    verify_steps: int = 0
    backoff: int = 0  # plain steps left before it speculates again
    failures: int = 0  # back-offs in a row


@dataclass
class SpecStats:
    """Totals since start (for /metrics)."""

    verify_rows: int = 0  # request-steps that verified at least one draft
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens accepted
    missed: int = 0  # waits for tokens in flight that found no draft (`SpecPolicy.missed`)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify row produced on average (accepted drafts plus the target's)."""
        return (self.accepted + self.verify_rows) / self.verify_rows if self.verify_rows else 0.0


@dataclass
class SpecPolicy:
    """Decides per step which decoding requests speculate and keeps their records."""

    k: int  # drafts per request at most
    max_batch: int  # no speculation in a step with more decoding requests
    stats: SpecStats = field(default_factory=SpecStats)
    _reqs: dict[str, _ReqSpec] = field(default_factory=dict)

    def allows(self, rid: str) -> bool:
        """Whether `rid` is not backing off (a question only)."""
        r = self._reqs.get(rid)
        return r is None or r.backoff == 0

    def select(self, rids: list[str]) -> set[str]:
        """Of a step's decoding requests, those that should speculate: none when there are
        more than `max_batch`, else all but those backing off (each step counts towards the
        end of their back-off)."""
        chosen = set()
        for rid in rids:
            r = self._reqs.setdefault(rid, _ReqSpec())
            if r.backoff > 0:
                r.backoff -= 1
            else:
                chosen.add(rid)
        return chosen if len(rids) <= self.max_batch else set()

    def record(self, rid: str, proposed: int, accepted: int) -> None:
        """A verify step of `rid` checked `proposed` drafts and kept `accepted`."""
        if proposed == 0:
            return
        self.stats.verify_rows += 1
        self.stats.proposed += proposed
        self.stats.accepted += accepted
        self._judge(rid, accepted)

    def missed(self, rid: str) -> None:
        """The loop waited for `rid`'s tokens in flight to speculate, and then it had no draft:
        a wait for nothing, judged like a verify step that kept no draft."""
        self.stats.missed += 1
        self._judge(rid, 0)

    def _judge(self, rid: str, accepted: int) -> None:
        r = self._reqs.setdefault(rid, _ReqSpec())
        r.verify_steps += 1
        r.mean_accepted += EMA_WEIGHT * (accepted - r.mean_accepted)
        if r.verify_steps == 1:
            r.mean_accepted = float(accepted)
        if r.verify_steps < PROBATION_STEPS:
            return
        if r.mean_accepted < MIN_MEAN_ACCEPTED:
            r.backoff = BACKOFF_STEPS << min(r.failures, MAX_BACKOFF_DOUBLINGS)
            r.verify_steps, r.failures = 0, r.failures + 1
        else:
            r.failures = 0

    def drop(self, rid: str) -> None:
        self._reqs.pop(rid, None)
