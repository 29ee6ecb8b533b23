"""Graceful shutdown of a real server process (random weights, raw HTTP): SIGTERM during 8 streams
and 4 non-streaming requests over chat, completions and /generate; a second SIGTERM; kill -9.
Each test stops its own server and then checks that no process of its tree and no socket
folder is left (each server makes its folder in a directory of the test's own). Every test
runs with one API server process and with two (the requests spread over them), and starts a
server (tens of seconds on a 2-core CPU, most of it imports): slow."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from serving_helpers import Server, descendants, start_server, still_alive

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time"
SHORT = 32  # tokens: at 12 requests, seconds of decoding on a CPU, long past the SIGTERM
LONG = 4000  # tokens: never finishes within the tests
# The 8 streams and the 4 non-streaming requests, by endpoint.
STREAMED = ["chat", "completions", "generate"] * 2 + ["chat", "completions"]
PLAIN = ["chat", "completions", "generate", "chat"]
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "generate": "/generate"}


def body(kind: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    if kind == "generate":
        params = {"max_new_tokens": max_tokens, "ignore_eos": True}
        return {"text": PROMPT, "sampling_params": params, "stream": stream}
    b: dict[str, Any] = {"model": "default", "max_tokens": max_tokens, "ignore_eos": True}
    b |= {"stream": stream, "stream_options": {"include_usage": True}} if stream else {}
    if kind == "chat":
        return b | {"messages": [{"role": "user", "content": PROMPT}]}
    return b | {"prompt": PROMPT}


@dataclass
class Answer:
    """What one request got: a JSON body, or the `data:` payloads of its events."""

    kind: str
    stream: bool
    status: int | None = None
    content_type: str = ""
    json: Any = None
    events: list[str] = field(default_factory=list)
    broken: Exception | None = None  # the connection ended before the answer did
    started: threading.Event = field(default_factory=threading.Event)  # first event or answer

    def run(self, server: Server, max_tokens: int) -> None:
        try:
            with httpx.Client(base_url=server.url, timeout=600) as c:
                b = body(self.kind, max_tokens, self.stream)
                with c.stream("POST", PATHS[self.kind], json=b) as r:
                    self.status, self.content_type = r.status_code, r.headers["content-type"]
                    if not self.content_type.startswith("text/event-stream"):
                        self.json = json.loads(r.read())
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            self.events.append(line.removeprefix("data: "))
                            self.started.set()
        except httpx.HTTPError as e:
            self.broken = e
        finally:
            self.started.set()

    def payloads(self) -> list[dict[str, Any]]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]

    def finish(self) -> tuple[str | None, int | None]:
        """The finish reason and completion tokens that the answer reports."""
        if self.kind == "generate":
            meta = (self.payloads()[-1] if self.stream else self.json)["meta_info"]
            return meta["finish_reason"], meta["completion_tokens"]
        if not self.stream:
            return self.json["choices"][0]["finish_reason"], self.json["usage"]["completion_tokens"]
        reasons = [c["finish_reason"] for p in self.payloads() for c in p["choices"]]
        return next((r for r in reasons if r), None), self.payloads()[-1]["usage"][
            "completion_tokens"
        ]


@dataclass
class Load:
    answers: list[Answer]
    threads: list[threading.Thread]

    def join(self) -> None:
        for t in self.threads:
            t.join(300)
            assert not t.is_alive(), "a request never ended"


def start_load(server: Server, max_tokens: int, streamed: list[str], plain: list[str]) -> Load:
    """The requests, each in a thread; returns once all run in the scheduler (every stream has
    had its first event)."""
    answers = [Answer(k, True) for k in streamed] + [Answer(k, False) for k in plain]
    threads = [threading.Thread(target=a.run, args=(server, max_tokens)) for a in answers]
    for t in threads:
        t.start()
    for a in answers[: len(streamed)]:
        assert a.started.wait(300), "a stream never began"
        assert a.status == 200 and a.events, (a, server.log_text()[-3000:])
    deadline = time.monotonic() + 300
    while running(server) < len(answers):
        assert time.monotonic() < deadline, "the requests never all ran"
        time.sleep(0.1)
    return Load(answers, threads)


def wait_for_drain(server: Server) -> None:
    """Until the server logs that its drain began (the gate is closed)."""
    deadline = time.monotonic() + 60
    while "shutting down: " not in server.log_text():
        assert time.monotonic() < deadline, server.log_text()[-3000:]
        time.sleep(0.05)


def running(server: Server) -> int:
    text = httpx.get(f"{server.url}/metrics").text
    match = re.search(r"^minisgl_num_running_reqs (\S+)$", text, re.M)
    assert match, text
    return int(float(match.group(1)))


@dataclass
class Tree:
    """A server's processes and socket folders, taken while it runs."""

    procs: list[psutil.Process]
    tmpdir: Path

    @staticmethod
    def of(server: Server, tmpdir: Path) -> Tree:
        tree = Tree(descendants(server.proc.pid), tmpdir)
        assert len(tree.procs) >= 3 and len(tree.folders()) == 1, (tree, tree.folders())
        return tree

    def folders(self) -> list[Path]:
        return list(self.tmpdir.glob("minisgl-*"))

    def assert_gone(self, within_s: float = 10) -> None:
        assert still_alive(self.procs, within_s) == [], "processes left behind"
        assert self.folders() == [], "the socket folder is left behind"


def in_flight(log: str, what: str) -> int:
    """The requests that the API processes' log lines `what` (with `N` for the number) count."""
    return sum(int(n) for n in re.findall(re.escape(what).replace("N", r"(\d+)"), log))


@pytest.fixture(params=[1, 2], ids=["1-api", "2-apis"])
def launch(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """Start a server with random weights, `request.param` API processes and `flags`; kills
    whatever is left at the end."""
    started: list[tuple[Server, Path]] = []
    apis = ("--api-server-count", str(request.param))

    def start(*flags: str) -> tuple[Server, Path]:
        tmpdir = tmp_path / f"tmp{len(started)}"
        tmpdir.mkdir()
        server = start_server(tmp_path, "--load-format", "dummy", *apis, *flags, tmpdir=tmpdir)
        started.append((server, tmpdir))
        server.wait_ready()
        return server, tmpdir

    yield start
    for server, _ in started:
        if server.proc.poll() is None:
            server.terminate()


def test_a_generous_timeout_lets_every_request_finish(launch: Any) -> None:
    server, tmpdir = launch("--shutdown-timeout", "600")
    load = start_load(server, SHORT, STREAMED, PLAIN)
    tree = Tree.of(server, tmpdir)
    server.proc.send_signal(signal.SIGTERM)
    wait_for_drain(server)
    # While the requests finish, nothing new gets in: 503 with the error body, /health too.
    for method, path in (("GET", "/health"), ("POST", "/v1/completions")):
        late = httpx.request(method, server.url + path, json=body("completions", 1, False))
        assert late.status_code == 503, late.text
        assert late.json()["error"] == {
            "message": "the server is shutting down",
            "type": "service_unavailable",
            "param": None,
            "code": None,
        }
        assert late.headers["connection"] == "close"
    load.join()
    assert server.proc.wait(120) == 0
    for a in load.answers:
        assert a.status == 200 and a.broken is None, a
        assert a.finish() == ("length", SHORT), a
        if a.stream:
            assert a.events[-1] == "[DONE]" and not any("error" in p for p in a.payloads())
    # All of them were running at SIGTERM.
    assert in_flight(server.log_text(), "shutting down: N requests in flight") == 12
    tree.assert_gone()


def test_a_short_timeout_answers_what_is_left_with_503(launch: Any) -> None:
    server, tmpdir = launch("--shutdown-timeout", "1")
    load = start_load(server, LONG, STREAMED, PLAIN)
    tree = Tree.of(server, tmpdir)
    server.proc.send_signal(signal.SIGTERM)
    load.join()
    assert server.proc.wait(120) == 0
    for a in load.answers:
        assert a.broken is None, a
        if a.stream:  # the stream's own chunks, then an error event and [DONE]
            assert a.status == 200 and a.content_type.startswith("text/event-stream"), a
            *chunks, error, done = a.payloads() + [a.events[-1]]
            assert done == "[DONE]" and chunks and not any("error" in c for c in chunks), a
            assert error["error"]["code"] is None, a
            assert "the server is shutting down" in error["error"]["message"], a
        else:
            assert a.status == 503 and a.content_type == "application/json", a
            assert a.json["error"]["type"] == "service_unavailable", a
            assert "the server is shutting down" in a.json["error"]["message"], a
    log = server.log_text()
    assert in_flight(log, "shutting down: N requests in flight") == 12
    assert in_flight(log, "answering the N requests still in flight") == 12
    tree.assert_gone()


def test_a_second_signal_exits_at_once(launch: Any) -> None:
    server, tmpdir = launch("--shutdown-timeout", "600")
    load = start_load(server, LONG, ["chat", "generate"], ["completions"])
    tree = Tree.of(server, tmpdir)
    server.proc.send_signal(signal.SIGTERM)
    wait_for_drain(server)
    assert httpx.get(f"{server.url}/health").status_code == 503
    assert server.proc.poll() is None  # draining: the requests could run for minutes
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 128 + signal.SIGTERM
    load.join()
    for a in load.answers:  # cut, not answered
        assert a.broken is not None or "[DONE]" not in a.events, a
    assert "SIGTERM again: exiting at once" in server.log_text()
    tree.assert_gone()


def test_workers_of_a_killed_server_exit_and_remove_the_folder(launch: Any) -> None:
    server, tmpdir = launch()
    load = start_load(server, LONG, ["chat"], [])
    tree = Tree.of(server, tmpdir)
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait()
    load.join()
    tree.assert_gone()
