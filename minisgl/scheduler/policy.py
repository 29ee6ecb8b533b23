"""Which request goes first: the order of the waiting queue, and which running request gives
way when the KV pool runs short.

`fcfs`: by arrival; the newest running request is retracted first. `priority`: by
`SamplingParams.priority` (lower is more urgent, as in vLLM), then arrival; the least urgent
running request is retracted first, and a waiting request that cannot be admitted for lack of
room retracts running ones less urgent than itself. Starvation guard: a request's effective
priority improves by one level for every `aging_s` seconds it has waited. Since every waiting
request ages at the same rate, that order never changes with time: it is the order of
`priority * aging_s + arrival_time`, a key fixed at arrival (so the queue stays sorted, and
every tensor-parallel rank, given rank 0's arrival times, orders alike).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from minisgl.config import SCHEDULE_POLICIES
from minisgl.core import InvalidRequestError, Req


@dataclass(frozen=True)
class SchedulePolicy:
    name: str = "fcfs"
    aging_s: float = 0.0  # priority only: seconds of waiting worth one priority level; 0: none

    def __post_init__(self) -> None:
        assert self.name in SCHEDULE_POLICIES and self.aging_s >= 0

    @property
    def by_priority(self) -> bool:
        return self.name == "priority"

    def key(self, req: Req) -> tuple[Any, ...]:
        """Sort key: smaller goes first and is retracted last."""
        if not self.by_priority:
            return (req.arrival,)
        if self.aging_s > 0:
            assert req.arrival_time is not None
            return (req.params.priority * self.aging_s + req.arrival_time, req.arrival)
        return (req.params.priority, req.arrival)

    def check(self, priority: int) -> None:
        """InvalidRequestError for a priority this policy cannot honour."""
        if priority != 0 and not self.by_priority:
            raise InvalidRequestError(
                f"priority: {priority} needs the priority schedule policy; this server "
                "schedules first come, first served (start it with --schedule-policy priority, "
                "or leave priority out)"
            )


class WaitingQueue:
    """Waiting requests in the policy's order (a sorted list: insertion is a binary search and
    a memmove, iteration is in order)."""

    def __init__(self, policy: SchedulePolicy) -> None:
        self.policy = policy
        self._reqs: list[Req] = []
        self._keys: list[tuple[Any, ...]] = []

    def push(self, req: Req) -> None:
        key = self.policy.key(req)
        i = bisect.bisect_right(self._keys, key)
        self._keys.insert(i, key)
        self._reqs.insert(i, req)

    def remove(self, req: Req) -> None:
        i = self._reqs.index(req)
        del self._reqs[i], self._keys[i]

    def __iter__(self) -> Iterator[Req]:
        return iter(list(self._reqs))  # a copy: callers remove while they iterate

    def __len__(self) -> int:
        return len(self._reqs)

    def __bool__(self) -> bool:
        return bool(self._reqs)

    def __contains__(self, req: object) -> bool:
        return any(r is req for r in self._reqs)
