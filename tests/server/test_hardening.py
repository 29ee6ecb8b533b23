"""Nothing one client sends, or fails to read, starves or exhausts a real server process: body,
prompt, sequence and queue limits, connection time-outs, a stream whose client stops reading,
and an API key from the environment that no log line shows (the server logs at debug level)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from serving_helpers import Server, running_server
from test_api import assert_pool_clean, metrics, wait_idle

pytestmark = pytest.mark.slow

API_KEY = "hardening-test-key-7f3a"
MAX_BYTES = 2_000_000
MAX_SEQS = 16
TIMEOUT_S = 2.0
FLAGS = [
    "--log-level",
    "debug",
    # Short prefill steps: an abort lands between two steps, after at most one short one.
    "--max-prefill-tokens",
    "1024",
    "--max-request-bytes",
    str(MAX_BYTES),
    "--max-seqs-per-request",
    str(MAX_SEQS),
    "--max-queued-seqs",
    str(MAX_SEQS),
    "--header-timeout",
    str(TIMEOUT_S),
    "--body-timeout",
    str(TIMEOUT_S),
    "--send-timeout",
    str(TIMEOUT_S),
    "--keep-alive-timeout",
    str(TIMEOUT_S),
]
GiB = 2**30


@dataclass
class PeakRss:
    """The tokenizer worker's largest resident set, sampled every 20 ms."""

    pid: int
    peak: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.wait(0.02):
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    self.peak = max(self.peak, int(line.split()[1]) * 1024)


@pytest.fixture(scope="module", params=[1, 2], ids=["1-api", "2-apis"])
def server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Server]:
    logs = tmp_path_factory.mktemp("logs")
    flags = [*FLAGS, "--api-server-count", str(request.param)]
    with running_server(logs, *flags, api_key=API_KEY, key_from="env") as s:
        yield s


@pytest.fixture(scope="module")
def rss(server: Server) -> Iterator[PeakRss]:
    sampler = PeakRss(server.worker_pid("tokenizer"))
    thread = threading.Thread(target=sampler.run, daemon=True)
    thread.start()
    yield sampler
    sampler.stop.set()
    thread.join()


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with server.http() as c:
        yield c


def tokenized(server: Server) -> int:
    """Requests the tokenizer worker has been handed (it logs each at debug level)."""
    return server.log_text().count("minisgl.tokenizer.workers: request ")


def head(path: str, length: int | None = None, chunked: bool = False) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: t", f"Authorization: Bearer {API_KEY}"]
    lines.append("Content-Type: application/json")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def connect(server: Server, small_buffers: bool = False) -> socket.socket:
    """A connection to the server; with `small_buffers`, the kernel's buffers for it hold
    about 150 KB instead of megabytes (a small receive buffer, and an Ethernet-sized MSS where
    loopback's 64 KB one would let the server's send buffer grow to 4 MB)."""
    s = socket.socket()
    if small_buffers:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1400)
    s.connect(("127.0.0.1", server.port))
    return s


def read_until_closed(s: socket.socket, limit: float = 60) -> tuple[bytes, float]:
    start, data = time.monotonic(), b""
    s.settimeout(limit)
    while True:
        try:
            chunk = s.recv(1 << 16)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - start


def parse(data: bytes) -> tuple[int, dict[str, str], Any]:
    top, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = top.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (h.split(":", 1) for h in header_lines)}
    return int(status_line.split()[1]), headers, json.loads(body) if body else None


def small_completion(server: Server) -> httpx.Response:
    with server.http() as c:
        return c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})


def wait_for(condition: Callable[[], bool], limit: float = 300) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, "the condition never came true"
        time.sleep(0.1)


# ---- the body and the prompt -----------------------------------------------------------------


def test_a_body_announced_too_large_gets_413_after_its_first_bytes(
    server: Server, rss: PeakRss
) -> None:
    before = tokenized(server)
    with ThreadPoolExecutor(1) as pool:
        s = connect(server)
        s.sendall(head("/v1/completions", length=20_000_000) + b'{"prompt": "' + b"a" * 1012)
        small = pool.submit(small_completion, server)  # while the big one is open
        data, _ = read_until_closed(s)  # the answer comes with 1 KB of 20 MB sent
        assert small.result().status_code == 200
    status, headers, body = parse(data)
    assert status == 413 and headers["connection"] == "close"
    assert body["error"]["code"] is None and "--max-request-bytes" in body["error"]["message"]
    assert tokenized(server) == before + 1  # the small request only
    assert rss.peak < GiB


def test_a_chunked_body_is_cut_once_it_passes_the_limit(server: Server) -> None:
    s = connect(server)
    s.sendall(head("/v1/completions", chunked=True))
    chunk = b'"' + b"a" * 65534 + b'"'
    sent = 0
    while sent <= MAX_BYTES:  # then stop: the rest of the body is never sent
        s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        sent += len(chunk)
    status, headers, body = parse(read_until_closed(s)[0])
    assert status == 413 and body["error"]["code"] is None


def test_a_million_character_prompt_is_refused_without_tokenizing(
    server: Server, http: httpx.Client, rss: PeakRss
) -> None:
    before = tokenized(server)
    with ThreadPoolExecutor(1) as pool:
        small = pool.submit(small_completion, server)
        r = http.post("/v1/completions", json={"prompt": "a" * 1_000_000, "max_tokens": 1})
        chat = http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "b" * 1_000_000}], "max_tokens": 1},
        )
        assert small.result().status_code == 200
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "1000000 characters cannot fit the context" in r.json()["error"]["message"]
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    assert tokenized(server) == before + 1  # the small request only
    assert rss.peak < GiB


# ---- sequences -------------------------------------------------------------------------------


def test_a_request_over_the_sequence_cap_is_refused(http: httpx.Client) -> None:
    body = {"prompt": ["a", "b", "c"], "n": 6, "max_tokens": 1}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert "18 sequences" in r.json()["error"]["message"]
    ok = http.post("/v1/completions", json={**body, "n": 5})  # 15
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 15


def test_a_flood_beyond_the_queue_cap_gets_503_then_the_server_serves(
    server: Server, http: httpx.Client
) -> None:
    wait_idle(http)
    # MAX_SEQS choices of a long prompt fill the queue until the first of them has a token.
    long = {"prompt": "hello " * 7000, "n": MAX_SEQS, "max_tokens": 1}
    content = json.dumps(long).encode()
    big = connect(server)
    big.sendall(head("/v1/completions", length=len(content)) + content)
    wait_for(lambda: metrics(http)["minisgl_num_queued_seqs"] == MAX_SEQS, 60)

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers) as c:
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
            return await asyncio.gather(
                *(c.post("/v1/chat/completions", json=body, timeout=60) for _ in range(12))
            )

    answers = asyncio.run(flood())
    assert metrics(http)["minisgl_num_queued_seqs"] == MAX_SEQS  # still waiting: none slipped in
    for r in answers:
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
        assert "--max-queued-seqs" in r.json()["error"]["message"]
    big.close()  # the client gives up: its choices are aborted
    wait_for(lambda: metrics(http)["minisgl_num_queued_seqs"] == 0, 60)
    assert small_completion(server).status_code == 200
    assert_pool_clean(wait_idle(http, timeout=120))


# ---- connection time-outs --------------------------------------------------------------------


def test_slow_headers_and_bodies_are_closed_at_the_time_out(server: Server) -> None:
    start = time.monotonic()
    slow_header = connect(server)
    slow_header.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")
    slow_body = connect(server)
    slow_body.sendall(head("/v1/completions", length=1000) + b'{"prompt": "a')
    for s, what in ((slow_header, "header"), (slow_body, "body")):
        data, _ = read_until_closed(s)
        assert time.monotonic() - start >= TIMEOUT_S - 0.1, what  # not before the time-out
        status, headers, body = parse(data)
        assert status == 408 and headers["connection"] == "close", what
        assert f"request's {what} did not arrive within" in body["error"]["message"]


def test_a_stream_whose_client_stops_reading_is_aborted_and_its_kv_freed(
    server: Server, http: httpx.Client
) -> None:
    before = wait_idle(http)
    aborts = before.get("minisgl_requests_total[abort]", 0)
    generated = before["minisgl_engine_generated_tokens"]
    # Big events (20 top logprobs for each of 16 choices) fill the buffers between the engine
    # and a client that reads nothing in a few steps.
    body = {
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 20,
        "n": MAX_SEQS,
    }
    content = json.dumps(body).encode()
    stalled = connect(server, small_buffers=True)
    stalled.sendall(head("/v1/chat/completions", length=len(content)) + content)
    wait_for(lambda: metrics(http).get("minisgl_requests_total[abort]", 0) == aborts + MAX_SEQS)
    after = wait_idle(http)
    assert after["minisgl_engine_generated_tokens"] - generated < MAX_SEQS * 2000
    assert http.post("/flush_cache").status_code == 200  # nothing holds KV any more
    assert_pool_clean(metrics(http))
    stalled.close()


# ---- the key ---------------------------------------------------------------------------------


def test_the_key_from_the_environment_works_and_is_never_shown(
    server: Server, http: httpx.Client
) -> None:
    assert http.get("/v1/models").status_code == 200
    wrong = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert API_KEY not in http.get("/metrics").text
    log = server.log_text()
    assert " DEBUG " in log  # every level was on
    assert API_KEY not in log
