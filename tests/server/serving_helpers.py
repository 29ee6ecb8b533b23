"""Real server processes on 127.0.0.1 for the tests of this package (a module with a name of
its own: every test directory has a conftest)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from minisgl.benchmark.serving import synthetic_tokenizer_model, wait_healthy
from minisgl.config.secrets import ENV_API_KEY

STARTUP_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def descendants(pid: int) -> list[psutil.Process]:
    """Every live process below `pid`."""
    return [p for p in psutil.Process(pid).children(recursive=True) if alive(p)]


def alive(p: psutil.Process) -> bool:
    """Whether `p` runs (the pid not reused by another process since, not a zombie)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def still_alive(procs: list[psutil.Process], limit_s: float) -> list[psutil.Process]:
    """Those of `procs` still running after waiting up to `limit_s` for them to exit."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and any(alive(p) for p in procs):
        time.sleep(0.1)
    return [p for p in procs if alive(p)]


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    api_key: str | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def http(self, timeout: float = 120) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)

    def openai(self, timeout: float = 120) -> object:
        import openai

        return openai.OpenAI(
            base_url=f"{self.url}/v1",
            api_key=self.api_key or "none",
            max_retries=0,
            timeout=timeout,
        )

    def async_openai(self, timeout: float = 300) -> object:
        import openai

        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1",
            api_key=self.api_key or "none",
            max_retries=0,
            timeout=timeout,
        )

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def worker_pid(self, name: str) -> int:
        """The pid the launcher logged for its `name` worker."""
        for line in self.log_text().splitlines():
            if f"started the {name} process" in line:
                return int(line.rsplit("pid ", 1)[1].strip(") "))
        raise AssertionError(f"no pid logged for {name}:\n{self.log_text()[-3000:]}")

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        why = wait_healthy(self.url, self.proc, timeout)
        if why is not None:
            raise AssertionError(f"{why}:\n{self.log_text()[-5000:]}")

    def terminate(self, timeout: float = 30) -> list[psutil.Process]:
        """SIGTERM the launcher, wait for it, and return the processes it left behind."""
        children = descendants(self.proc.pid)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        left = still_alive(children, 5)
        for p in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        return left


def start_server(
    log_dir: Path,
    *args: str,
    api_key: str | None = None,
    key_from: str = "flag",
    tmpdir: Path | None = None,
) -> Server:
    """Start `python -m minisgl` on a free port (without waiting for it to be ready), with
    `api_key` given by `key_from`: "flag" (--api-key), "file" (--api-key-file) or "env"; with
    `tmpdir`, the server makes its socket folder there rather than in /tmp."""
    port = free_port()
    log = log_dir / f"server-{port}.log"
    argv = [sys.executable, "-m", "minisgl", "--port", str(port), *args]
    env = {k: v for k, v in os.environ.items() if k != ENV_API_KEY}
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    if api_key and key_from == "flag":
        argv += ["--api-key", api_key]
    elif api_key and key_from == "file":
        key_file = log_dir / f"api-key-{port}"
        key_file.write_text(api_key + "\n")
        argv += ["--api-key-file", str(key_file)]
    elif api_key:
        assert key_from == "env", key_from
        env[ENV_API_KEY] = api_key
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
    return Server(proc, port, log, api_key)


@contextlib.contextmanager
def running_server(log_dir: Path, *args: str, **options: Any) -> Iterator[Server]:
    """A started and ready server for a test module (`options`: `start_server`'s); stopped by
    SIGTERM at the end, which must leave no process behind."""
    server = start_server(log_dir, *args, **options)
    try:
        server.wait_ready()
        yield server
    finally:
        left = server.terminate()
    assert not left, f"SIGTERM left processes behind: {left}"


def metrics(http: httpx.Client) -> dict[str, float]:
    """/metrics as {name[label values...]: value}."""
    text = http.get("/metrics").text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + "".join(f"[{v}]" for v in s.labels.values())
            out[key] = s.value
    return out


QWEN3_06B = Path(__file__).resolve().parents[2] / "minisgl" / "benchmark" / "models" / "qwen3-0.6b"


def tiny_dummy_model(directory: Path) -> str:
    """A config-only model directory (the Qwen3-0.6B config shrunk to a few thousand
    parameters, for `--load-format dummy`) with the benchmark's synthetic tokenizer."""
    config = json.loads((QWEN3_06B / "config.json").read_text())
    config |= dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16,
                   num_key_value_heads=2, num_hidden_layers=2, vocab_size=10000, eos_token_id=2)  # fmt: skip
    (directory / "cfg").mkdir()
    (directory / "cfg" / "config.json").write_text(json.dumps(config))
    return synthetic_tokenizer_model(str(directory / "cfg"), directory)
