"""A worker that dies fails what is in flight and /health within seconds; SIGTERM and startup
failures leave no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from serving_helpers import Server, start_server

# Each module starts a real server (about 30 s of model loading on a 2-core CPU).
pytestmark = pytest.mark.slow

LONG = {"max_tokens": 2000, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "user", "content": "Tell me a long story."}]


@pytest.fixture(scope="module", params=[1, 2], ids=["1-api", "2-apis"])
def server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("logs"), "--api-server-count", str(request.param))
    try:
        s.wait_ready()
        yield s
    finally:
        if s.proc.poll() is None:
            s.terminate()


def _in_flight(
    client: Any, results: dict[str, Any], first_chunk: threading.Event
) -> list[threading.Thread]:
    def streaming() -> None:
        try:
            for _ in client.chat.completions.create(
                model="default", messages=MESSAGES, stream=True, **LONG
            ):
                first_chunk.set()
            results["stream"] = "finished"
        except openai.APIError as e:
            results["stream"] = e
        results["stream_at"] = time.monotonic()

    def blocking() -> None:
        try:
            client.chat.completions.create(model="default", messages=MESSAGES, **LONG)
            results["plain"] = "finished"
        except openai.APIError as e:
            results["plain"] = e
        results["plain_at"] = time.monotonic()

    threads = [threading.Thread(target=f, daemon=True) for f in (streaming, blocking)]
    for t in threads:
        t.start()
    return threads


def test_killing_the_scheduler_fails_requests_and_health(server: Server) -> None:
    client = server.openai(timeout=60)
    results: dict[str, Any] = {}
    first_chunk = threading.Event()
    threads = _in_flight(client, results, first_chunk)
    assert first_chunk.wait(120), "the streaming request never started"
    os.kill(server.worker_pid("scheduler"), signal.SIGKILL)
    killed_at = time.monotonic()
    for t in threads:
        t.join(30)
    assert isinstance(results["stream"], openai.APIError), results
    assert isinstance(results["plain"], openai.InternalServerError), results
    assert results["plain"].status_code == 503
    assert "scheduler" in results["plain"].message
    assert results["stream_at"] - killed_at < 5 and results["plain_at"] - killed_at < 5
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503 and "scheduler" in health.json()["error"]["message"]
    with pytest.raises(openai.InternalServerError):  # later requests fail at once
        client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=2)


def test_sigterm_stops_every_process(server: Server) -> None:
    children = server.terminate()
    assert children == []
    assert server.proc.returncode is not None


def test_a_worker_that_cannot_load_stops_the_launch(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file")
    p = subprocess.run(
        [sys.executable, "-m", "minisgl", "--model", str(bad), "--port", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 1
    assert "failed to start" in p.stderr
    pids = [
        int(line.rsplit("pid ", 1)[1].strip(") "))
        for line in p.stderr.splitlines()
        if "started the" in line
    ]
    assert pids and not any(Path(f"/proc/{pid}").exists() for pid in pids)
