"""Several API server processes on one port (`--api-server-count`), against one of them: 200
streams at once, each joined to its non-streaming answer; /metrics counting every request once
whichever process served it; a burst admitted in the order it arrived. A SmolLM2 server per
count: slow."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serving_helpers import Server, running_server
from test_api import wait_idle

pytestmark = pytest.mark.slow

RUNNING = 32  # requests decoded at once: a burst of 256 queues


@pytest.fixture(scope="module", params=[1, 2], ids=["1-api", "2-apis"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    logs = tmp_path_factory.mktemp("logs")
    flags = ("--api-server-count", str(request.param), "--max-running-requests", str(RUNNING))
    with running_server(logs, *flags) as s:
        yield s


def num_apis(server: Server) -> int:
    return server.log_text().count("started the api")


async def completion(c: httpx.AsyncClient, body: dict[str, Any]) -> Any:
    """A completion's JSON (non-streaming) or its events' payloads (streaming)."""
    if not body.get("stream"):
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()
    events = []
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
    return events


def fresh_connections(server: Server) -> httpx.AsyncClient:
    """A client that opens a connection per request (each lands on any API process)."""
    limits = httpx.Limits(max_connections=300, max_keepalive_connections=0)
    return httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits)


def run_all(server: Server, bodies: list[dict[str, Any]]) -> list[Any]:
    async def go() -> list[Any]:
        async with fresh_connections(server) as c:
            return await asyncio.gather(*(completion(c, b) for b in bodies))

    return asyncio.run(go())


def test_200_streams_join_to_their_non_streaming_answers(server: Server) -> None:
    bodies = [
        {"prompt": f"Fact number {i} about the sea:", "max_tokens": 8, "temperature": 0}
        for i in range(200)
    ]
    plain = run_all(server, bodies)
    streamed = run_all(server, [{**b, "stream": True} for b in bodies])
    for answer, events in zip(plain, streamed, strict=True):
        choice = answer["choices"][0]
        assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]
        assert events[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]


def test_metrics_count_every_request_once(server: Server) -> None:
    with server.http() as http:
        before = wait_idle(http)
        bodies = [
            {"prompt": f"Say {i}", "max_tokens": 3, "stream": i % 2 == 1, "ignore_eos": True}
            for i in range(60)
        ]

        async def go() -> list[Any]:
            async with fresh_connections(server) as c:
                gen = [
                    c.post("/generate", json={"text": f"Hi {i}", "sampling_params": {
                        "max_new_tokens": 2, "ignore_eos": True}})
                    for i in range(20)
                ]  # fmt: skip
                return await asyncio.gather(*gen, *(completion(c, b) for b in bodies))

        answers = asyncio.run(go())
        after = wait_idle(http)
    ids = [r.json()["meta_info"]["id"] for r in answers[:20]]
    if num_apis(server) == 2:  # the processes' ids are marked by them: both served some
        assert {i[:2] for i in ids} == {"00", "01"}, ids

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("minisgl_requests_total[length]") == 80
    assert delta("minisgl_e2e_request_latency_seconds_count") == 80
    assert delta("minisgl_time_to_first_token_seconds_count") == 80
    assert delta("minisgl_generation_tokens_total") == 20 * 2 + 60 * 3
    # Every token after a request's first counts one inter-token gap.
    assert delta("minisgl_inter_token_latency_seconds_count") == 20 * 1 + 60 * 2


def test_a_burst_is_admitted_in_arrival_order(server: Server) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 2, "ignore_eos": True,
            "return_token_times": True}  # fmt: skip
    answers = run_all(server, [body] * 256)
    # (when the API took it, when the scheduler had its first token), by arrival
    times = sorted((a["usage"]["received_at"], a["usage"]["token_times"][0][0]) for a in answers)
    quarter = len(times) // 4
    first, last = [t for _, t in times[:quarter]], [t for _, t in times[-quarter:]]
    # With RUNNING requests decoded at once the burst runs in batches: the first to arrive are
    # served before the last (none waits behind a later one for more than a batch or so).
    assert max(first) <= min(last), (max(first), min(last))
