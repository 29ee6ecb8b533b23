"""Priorities, the server's token times and the scheduling metrics through real server
processes (a tiny dummy model with a synthetic tokenizer): a bad or unhonoured priority gets a
400 naming the field; under the priority policy requests carry one and /metrics reports queue
time, TTFT and inter-token latency per priority, retractions and the step-time model; answers
carry the scheduler's time of every token on request, and the serving benchmark reads them."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from serving_helpers import Server, metrics, start_server, tiny_dummy_model

from minisgl.benchmark.serving import Workload, run_clients, summarize

pytestmark = pytest.mark.slow


@dataclass
class Servers:
    fcfs: Server
    priority: Server


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    tmp = tmp_path_factory.mktemp("sched")
    model = tiny_dummy_model(tmp)
    common = ["--model", model, "--load-format", "dummy", "--num-pages", "4096"]
    fcfs = start_server(tmp, *common, "--skip-warmup")
    prio = start_server(tmp, *common, "--schedule-policy", "priority", "--priority-aging-s", "5")
    try:
        fcfs.wait_ready()
        prio.wait_ready()
        yield Servers(fcfs, prio)
    finally:
        left = fcfs.terminate() + prio.terminate()
    assert not left


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def completion(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **extra}


def generate(ids: list[int], stream: bool = False, **sampling: Any) -> dict[str, Any]:
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True, **sampling}
    return {"input_ids": ids, "sampling_params": params, "stream": stream}


def assert_400(r: httpx.Response, param: str, message: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error


@pytest.mark.parametrize("value", [1.5, True, "1", None])
def test_a_priority_that_is_not_an_integer_is_refused(servers: Servers, value: Any) -> None:
    for server in (servers.fcfs, servers.priority):
        r = post(server, "/v1/completions", completion([5, 6], priority=value))
        if value is None:  # an explicit null is a field left out (OpenAI bodies)
            assert r.status_code == 200, r.text
            continue
        assert_400(r, "priority", "priority")
        chat = {"messages": [{"role": "user", "content": "t5"}], "priority": value}
        assert_400(post(server, "/v1/chat/completions", chat), "priority", "priority")
    if value is not None:
        r = post(servers.fcfs, "/generate", generate([5, 6], priority=value))
        assert_400(r, "sampling_params.priority", "priority")


def test_a_priority_under_fcfs_is_refused(servers: Servers) -> None:
    why = "needs the priority schedule policy"
    for stream in (False, True):
        r = post(servers.fcfs, "/v1/completions", completion([5, 6], priority=3, stream=stream))
        assert_400(r, "priority", why)
        r = post(servers.fcfs, "/generate", generate([5, 6], stream, priority=-1))
        assert_400(r, "priority", why)
    # Priority 0 is every request's under fcfs: accepted.
    assert post(servers.fcfs, "/v1/completions", completion([5, 6], priority=0)).status_code == 200


def test_answers_carry_the_scheduler_token_times(servers: Servers) -> None:
    server = servers.priority
    r = post(server, "/generate", generate([5, 6, 7], priority=2) | {"return_token_times": True})
    times = r.json()["meta_info"]["token_times"]
    assert len(times) == 4 and times == sorted(times)
    sent = time.time()
    r = post(server, "/v1/completions", completion([8, 9], n=2, return_token_times=True))
    per_choice = r.json()["usage"]["token_times"]
    assert [len(t) for t in per_choice] == [4, 4]
    # When the API took the request: after it was sent (same host clock), before any token.
    assert sent <= r.json()["usage"]["received_at"] <= min(t[0] for t in per_choice)
    assert "token_times" not in post(server, "/v1/completions", completion([8])).json()["usage"]
    # A stream carries them in its usage chunk, so it must ask for one.
    r = post(server, "/v1/completions", completion([8], stream=True, return_token_times=True))
    assert_400(r, "return_token_times", "include_usage")
    body = completion([8], stream=True, return_token_times=True)
    body["stream_options"] = {"include_usage": True}
    events = [line[6:] for line in post(server, "/v1/completions", body).text.splitlines()]
    usage = [json.loads(e)["usage"] for e in events if e.startswith("{")][-1]
    assert len(usage["token_times"][0]) == usage["completion_tokens"] == 4
    assert 0 < usage["received_at"] <= usage["token_times"][0][0]
    r = post(server, "/generate", generate([5, 6], True) | {"return_token_times": True})
    metas = [json.loads(line[6:])["meta_info"] for line in r.text.splitlines() if "{" in line]
    assert len(metas[-1]["token_times"]) == 4 and "token_times" not in metas[0]


def test_two_priority_classes_through_the_benchmark_and_metrics(servers: Servers) -> None:
    server = servers.priority
    work = Workload.draw(12, 4, (8, 40), (3, 12)).with_classes([0, 1], seed=4)
    assert set(work.priorities) == {0, 1}
    traces = run_clients(server.url, work, float("inf"), 0, procs=2)
    result = summarize(traces, work)
    assert result["incomplete"] == 0 and result["untimed"] == 0
    assert [t.priority for t in traces] == work.priorities
    by = result["by_priority"]
    assert by["0"]["requests"] + by["1"]["requests"] == 12
    assert by["0"]["itl_server_ms"]["p50"] > 0 and by["1"]["ttft_ms"]["p50"] > 0
    with httpx.Client(base_url=server.url) as http:
        m = metrics(http)
    for p in ("0", "1"):
        assert m[f"minisgl_queue_time_seconds_count[{p}]"] >= by[p]["requests"]
        assert m[f"minisgl_time_to_first_token_by_priority_seconds_count[{p}]"] >= by[p]["requests"]
        assert m[f"minisgl_inter_token_latency_by_priority_seconds_count[{p}]"] > 0
    # The step-time model: fitted at start-up (the warm-up ran), compared with every step since.
    assert m["minisgl_steps_timed"] > 0 and m["minisgl_step_time_seconds[measured]"] > 0
    assert m["minisgl_step_model_coefficient_seconds[base]"] >= 0
    assert m["minisgl_retractions"] == 0  # a pool large enough for everyone
