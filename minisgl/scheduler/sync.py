"""Keep every tensor-parallel rank's scheduler fed with the same requests and aborts (and
rank 0's measured step times, which the prefill budget depends on).

Rank 0 alone takes requests and aborts; its scheduler applies them at once and records them
here. At the top of every step each rank calls `exchange`: rank 0 broadcasts what it recorded
since the last step and the other ranks apply it to their own schedulers, in the same order.
Every scheduler then holds the same state and makes the same decisions, so the ranks meet in
the model's collectives without ever waiting on each other for anything else.

The bytes travel over a gloo group of their own (also when the model's group is NCCL): they are
tiny, live on the host, and the group's timeout must allow rank 0 to sit idle for hours.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgpack
import torch
import torch.distributed as dist

from minisgl.core import Req, SamplingParams
from minisgl.distributed import RankFailedError
from minisgl.scheduler.step_time import StepShape


class EngineStopped(Exception):
    """Raised on ranks 1..N-1 inside a step when rank 0 has shut the engine down."""


class RequestSink(Protocol):
    """What `exchange` applies the recorded operations to (the `Scheduler`)."""

    def add_request(self, req: Req) -> None: ...

    def abort(self, rid: str) -> Req | None: ...

    def grammar_ready(self, rid: str) -> None: ...

    def apply_step_times(self, samples: list[tuple[StepShape, float]], anchor: bool) -> None: ...


BLAME_WAIT_S = 1.0

# One recorded operation: ["add", rid, prompt_ids, params, seed, arrival_time] |
# ["abort", rid] | ["grammar_ready", rid] | ["step_times", [[shape fields..., seconds], ...],
# anchor] | ["stop"].
Op = list[Any]


class RequestSync:
    """Rank 0 records requests and aborts; `exchange` replays them on every other rank.

    `health` (rank 0) is called before each broadcast and raises RankFailedError when a rank is
    known to be gone, so a dead rank is reported at once rather than at the next collective.
    """

    def __init__(self, group: Any, rank: int, health: Callable[[], None] | None = None) -> None:
        self.group = group
        self.rank = rank
        self.health = health
        self._ops: list[Op] = []
        self._replaying = False
        self._failure: str | None = None

    # ---- rank 0: record --------------------------------------------------------------------

    def publish_add(self, req: Req) -> None:
        params = dataclasses.asdict(req.params)
        self._record(["add", req.rid, list(req.prompt_ids), params, req.seed, req.arrival_time])

    def publish_abort(self, rid: str) -> None:
        self._record(["abort", rid])

    def publish_grammar_ready(self, rid: str) -> None:
        self._record(["grammar_ready", rid])

    def publish_step_times(self, samples: list[tuple[StepShape, float]], anchor: bool) -> None:
        """Rank 0's measured step times, for every rank's step-time model."""
        assert self.rank == 0
        self._record(["step_times", [[*dataclasses.astuple(s), t] for s, t in samples], anchor])

    def _record(self, op: Op) -> None:
        """Rank 0 keeps `op` for the next `exchange`; another rank only replays rank 0's."""
        if self.rank == 0:
            self._ops.append(op)
        else:
            assert self._replaying, f"rank {self.rank} takes requests only from rank 0"

    def stop(self) -> None:
        """Rank 0: tell the other ranks to leave their loops (at their next `exchange`)."""
        assert self.rank == 0
        self._ops.append(["stop"])
        try:
            self._broadcast()
        finally:
            self._failure = "this engine was closed; create a new one"

    # ---- every rank: once per step -----------------------------------------------------------

    def exchange(self, sink: RequestSink) -> None:
        """Rank 0 sends what it recorded; the others apply it to `sink` (their scheduler)."""
        if self.rank == 0:
            self._broadcast()
            return
        data = self._broadcast()
        ops = msgpack.unpackb(data) if data else []
        self._replaying = True
        try:
            for op in ops:
                self._apply(op, sink)
        finally:
            self._replaying = False

    @staticmethod
    def _apply(op: Op, sink: RequestSink) -> None:
        kind = op[0]
        if kind == "add":
            _, rid, prompt_ids, params, seed, arrival_time = op
            req = Req(rid=rid, prompt_ids=prompt_ids, params=SamplingParams(**params), seed=seed)
            req.arrival_time = arrival_time  # rank 0's: the priority policy orders by it
            sink.add_request(req)
        elif kind == "abort":
            sink.abort(op[1])
        elif kind == "grammar_ready":
            sink.grammar_ready(op[1])
        elif kind == "step_times":
            sink.apply_step_times([(StepShape(*row[:-1]), row[-1]) for row in op[1]], op[2])
        elif kind == "stop":
            raise EngineStopped
        else:
            raise AssertionError(f"unknown sync operation {kind!r}")

    def _broadcast(self) -> bytes:
        """Rank 0's recorded operations, packed, on every rank (b"" for none); a length, then
        the bytes."""
        if self._failure is not None:
            raise RankFailedError(self._failure)
        try:
            if self.health is not None:
                self.health()
            return self._send_or_receive()
        except RankFailedError as e:
            self._failure = str(e)
            raise
        except RuntimeError as e:  # gloo reports a peer that went away as a RuntimeError
            self._failure = self._blame() or f"lost contact with {self._peer}: {e}"
            raise RankFailedError(self._failure) from e

    @property
    def _peer(self) -> str:
        return "a tensor-parallel rank" if self.rank == 0 else "rank 0"

    def _blame(self) -> str | None:
        """Which rank died, if a local one did: its sockets close a moment before the
        process can be reaped, so give `health` that moment."""
        deadline = time.monotonic() + BLAME_WAIT_S
        while self.health is not None and time.monotonic() < deadline:
            try:
                self.health()
            except RankFailedError as e:
                return str(e)
            time.sleep(0.02)
        return None

    def _send_or_receive(self) -> bytes:
        payload = msgpack.packb(self._ops) if self.rank == 0 and self._ops else b""
        self._ops = []
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.group)
        n = int(size.item())
        if n == 0:
            return b""
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            buf = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.group)
        return buf.numpy().tobytes()
