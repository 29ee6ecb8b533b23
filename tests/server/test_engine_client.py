"""The API server's routing of outputs to requests, with real sockets standing in for the
tokenizer (reads what the client sends) and the detokenizer (writes what the client reads)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from minisgl.core import SamplingParams
from minisgl.message import (
    AbortReq,
    DetokOut,
    GenerateReq,
    RequestError,
    SchedulerStats,
    StrOut,
)
from minisgl.message.transport import IpcPaths, Receiver, Sender
from minisgl.server.engine_client import EngineClient, EngineUnavailable, RequestRejected
from minisgl.server.metrics import Metrics

STATS = SchedulerStats(0, 0, 10, 0, 0, 0, 10, 0, 0, 0)


@pytest.fixture
def ipc(tmp_path: Path) -> IpcPaths:
    return IpcPaths.in_dir(tmp_path)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def req(*rids: str) -> GenerateReq:
    return GenerateReq(list(rids), [0] * len(rids), SamplingParams(), 4, text="hi")


def out(rid: str, text: str, finished: bool = False) -> StrOut:
    return StrOut(rid, text, [1], finished, "length" if finished else None, 2, 0, 1)


async def with_client(ipc: IpcPaths, body: object) -> None:
    client = EngineClient(ipc, Metrics())
    client.start()
    try:
        await body(client)  # type: ignore[operator]
    finally:
        await client.stop()


def test_outputs_reach_their_choice_merged_in_order(ipc: IpcPaths, ctx: zmq.Context) -> None:
    tokenizer = Receiver(ctx, ipc.tokenizer)
    detok = Sender(ctx, ipc.api)

    async def body(client: EngineClient) -> None:
        stream = client.submit([req("a", "b")])
        assert tokenizer.recv().rids == ["a", "b"]
        detok.send(DetokOut([out("a", "x"), out("a", "y"), out("b", "z", True)], STATS))
        await asyncio.sleep(0.2)
        detok.send(DetokOut([out("a", "!", True)], STATS))
        batches = [batch async for batch in stream]
        flat = [(c.index, c.out.text, c.out.finished) for b in batches for c in b]
        assert flat[:2] == [(0, "xy", False), (1, "z", True)]  # consecutive outputs merged
        assert flat[2:] == [(0, "!", True)]
        assert client.stats == STATS and client.num_live_requests == 0

    asyncio.run(with_client(ipc, body))


def test_closing_a_stream_aborts_unfinished_choices(ipc: IpcPaths, ctx: zmq.Context) -> None:
    tokenizer = Receiver(ctx, ipc.tokenizer)
    detok = Sender(ctx, ipc.api)

    async def body(client: EngineClient) -> None:
        stream = client.submit([req("a", "b")])
        detok.send(DetokOut([out("b", "done", True)], STATS))
        await stream.next_batch()
        stream.close()
        assert isinstance(tokenizer.recv(), GenerateReq)
        assert tokenizer.recv() == AbortReq("a")  # b finished: nothing to abort
        detok.send(DetokOut([out("a", "late", True)], STATS))  # dropped quietly
        await asyncio.sleep(0.1)
        assert client.num_live_requests == 0

    asyncio.run(with_client(ipc, body))


def test_refusals_and_failures_raise_in_the_stream(ipc: IpcPaths, ctx: zmq.Context) -> None:
    refuser = Sender(ctx, ipc.api)

    async def body(client: EngineClient) -> None:
        refused = client.submit([req("a")])
        refuser.send(RequestError(["a"], "prompt: too long", "prompt", 400))
        with pytest.raises(RequestRejected, match="too long") as e:
            await refused.next_batch()
        assert e.value.param == "prompt" and e.value.status == 400
        waiting = client.submit([req("b")])
        client.fail_all("the scheduler process exited")
        with pytest.raises(EngineUnavailable, match="scheduler"):
            await waiting.next_batch()
        with pytest.raises(EngineUnavailable):
            client.submit([req("c")])

    asyncio.run(with_client(ipc, body))


def test_a_refusal_that_lands_before_anyone_waits_is_still_raised(
    ipc: IpcPaths, ctx: zmq.Context
) -> None:
    refuser = Sender(ctx, ipc.api)

    async def body(client: EngineClient) -> None:
        refused = client.submit([req("a")])
        refuser.send(RequestError(["a"], "min_tokens: above max_tokens", "min_tokens", 400))
        while client.num_live_requests:  # the refusal lands before the stream is read
            await asyncio.sleep(0.01)
        with pytest.raises(RequestRejected, match="min_tokens"):
            async for _ in refused:
                pass

    asyncio.run(with_client(ipc, body))


def test_a_step_of_gaps_counts_as_that_many_observations() -> None:
    one_by_one, batched = Metrics(), Metrics()
    gaps = {(0.0042, 0): 3, (0.25, 1): 2, (0.002, 0): 1}  # (gap, priority): tokens
    for (gap, priority), n in gaps.items():
        for _ in range(n):
            one_by_one.itl.observe(gap)
            one_by_one.itl_by_priority.labels(str(priority)).observe(gap)
    batched.on_tokens(gaps)
    keep = ("minisgl_inter_token_latency",)
    lines = [
        [x for x in m.render().decode().splitlines() if x.startswith(keep) and "_created" not in x]
        for m in (one_by_one, batched)
    ]
    assert lines[0] == lines[1] and len(lines[0]) > 40
