"""The API server process alone, against a fake engine: what it costs per streamed token, and how
long a burst of requests waits to be read. `python -m minisgl.benchmark.front_door`.

A fake engine process takes the API's requests where the tokenizer would and answers where the
detokenizer would: every `--step-ms` it sends one output message with one token ("x ") for each
live request, until each has its `max_tokens`. So the engine side costs next to nothing, and
the API process (started as the server starts it) is the only thing measured: its CPU time over
the run (from /proc) divided by the tokens streamed is its cost per token (`--api-servers N`:
of N such processes together); `--profile PATH` writes each one's cProfile statistics to
PATH.K. The clients are `benchmark.serving`'s (streamed completions
from `--client-procs` processes, all sent at once), which also give the ingest delay (client
send to the handler taking the request). Prints a table, then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minisgl.benchmark.serving import Workload, latencies, run_clients
from minisgl.message import (
    AbortReq,
    DetokOut,
    EngineInfo,
    FlushCacheOut,
    FlushCacheReq,
    GenerateReq,
    SchedulerStats,
    StrOut,
)
from minisgl.message.transport import ApiSenders, IpcPaths, Receiver, worker_context

INFO = EngineInfo("fake", max_context=4096, num_pages=1 << 20, page_size=1, vocab_size=10000,
                  max_token_chars=16)  # fmt: skip


@dataclass
class _Live:
    max_tokens: int
    prompt_tokens: int
    done: int = 0


@dataclass
class FakeEngine:
    """Answers every request with `max_tokens` tokens of "x ", one per step for all at once."""

    inbox: Receiver
    api: ApiSenders
    step_s: float
    live: dict[str, _Live] = field(default_factory=dict)
    steps: int = 0

    def take(self, msg: Any) -> None:
        if isinstance(msg, GenerateReq):
            prompt = len(msg.input_ids or ()) or msg.prompt_chars
            for rid in msg.rids:
                self.live[rid] = _Live(msg.max_tokens or 16, prompt)
        elif isinstance(msg, AbortReq):
            self.live.pop(msg.rid, None)
        elif isinstance(msg, FlushCacheReq):
            self.api.send(FlushCacheOut(msg.token, 0))

    def step(self) -> None:
        outs = []
        for rid, r in list(self.live.items()):
            r.done += 1
            finished = r.done >= r.max_tokens
            reason = "length" if finished else None
            outs.append(StrOut(rid, "x ", [7], finished, reason, r.prompt_tokens, 0, r.done))
            if finished:
                del self.live[rid]
        self.steps += 1
        stats = SchedulerStats(len(self.live), 0, 0, 0, 0, 0, 1, 0, 0, 0, time=time.time())
        self.api.send(DetokOut(outs, stats))

    def run_forever(self) -> None:
        next_step = time.monotonic()
        while True:
            for msg in self.inbox.drain():
                self.take(msg)
            now = time.monotonic()
            if now >= next_step:
                if self.live:
                    self.step()
                next_step = max(next_step + self.step_s, now)
            time.sleep(min(0.0005, max(0.0, next_step - time.monotonic())))


def fake_engine_main(ipc: IpcPaths, step_s: float) -> None:
    ctx = worker_context()
    FakeEngine(Receiver(ctx, ipc.tokenizer), ApiSenders(ctx, ipc), step_s).run_forever()


def api_main(ipc: IpcPaths, index: int, port: int, queued: Any, profile: str | None) -> None:
    """API server process `index` as `python -m minisgl` runs it, on `port`, with no worker to
    watch (`minisgl.runtime.launch`)."""
    import cProfile
    import signal

    import uvicorn

    from minisgl.runtime.child import freeze_gc
    from minisgl.runtime.launch import listening_socket
    from minisgl.server.app import ServerState, build_app
    from minisgl.server.connection import Deadlines, uvicorn_options

    app = build_app(ServerState(INFO, ipc, index=index, queued=queued))
    config = uvicorn.Config(app, log_level="warning", **uvicorn_options(Deadlines()))
    listener = listening_socket("127.0.0.1", port, share=True)
    freeze_gc()
    if profile is not None:
        prof = cProfile.Profile()

        def dump(*_: Any) -> None:
            prof.disable()
            prof.dump_stats(profile)

        signal.signal(signal.SIGTERM, dump)
        prof.enable()
    uvicorn.Server(config).run(sockets=[listener])


def cpu_seconds(pid: int) -> float:
    """CPU time of process `pid`'s threads so far (Linux's scheduler statistics: nanoseconds,
    where /proc/PID/stat counts 10 ms ticks)."""
    tasks = Path(f"/proc/{pid}/task").glob("*/schedstat")
    return sum(int(t.read_text().split()[0]) for t in tasks) / 1e9


def measure(args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        ipc = IpcPaths.in_dir(tmp, args.api_servers)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        engine = ctx.Process(target=fake_engine_main, args=(ipc, args.step_ms / 1e3), daemon=True)
        queued = ctx.Value("i", 0)
        profiles = [
            f"{args.profile}.{k}" if args.profile else None for k in range(args.api_servers)
        ]
        apis = [
            ctx.Process(target=api_main, args=(ipc, k, port, queued, profiles[k]), daemon=True)
            for k in range(args.api_servers)
        ]
        for p in (engine, *apis):
            p.start()
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url)
            return _runs(args, url, [api.pid or 0 for api in apis])
        finally:
            for api in apis:
                api.terminate()
                api.join(10)
            engine.kill()


def _wait_healthy(url: str, timeout_s: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError(f"the API process did not answer in {timeout_s} s")


def _runs(args: argparse.Namespace, url: str, pids: list[int]) -> dict[str, Any]:
    work = Workload([[1] * args.prompt_len] * args.num_requests,
                    [args.output_len] * args.num_requests)  # fmt: skip
    run_clients(url, Workload([[1]] * 4, [2] * 4), float("inf"), 0, 1)  # warm-up
    best: dict[str, Any] | None = None
    for _ in range(args.repeats):
        cpu0, t0 = sum(map(cpu_seconds, pids)), time.perf_counter()
        traces = run_clients(url, work, float("inf"), args.seed, args.client_procs)
        cpu, wall = sum(map(cpu_seconds, pids)) - cpu0, time.perf_counter() - t0
        tokens = sum(t.completion_tokens for t in traces)
        run = {
            "tokens": tokens,
            "events": sum(len(t.chunks) for t in traces),  # SSE events with text
            "wall_s": wall,
            "api_cpu_s": cpu,
            "api_us_per_token": cpu / tokens * 1e6,
            "api_cpu_share": cpu / wall,
            **latencies(traces),
        }
        if best is None or run["api_us_per_token"] < best["api_us_per_token"]:
            best = run
    assert best is not None
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128, help="token ids per prompt")
    p.add_argument("--output-len", type=int, default=64, help="tokens per request")
    p.add_argument("--step-ms", type=float, default=12.0, help="the fake engine's step period")
    p.add_argument("--client-procs", type=int, default=1)
    p.add_argument("--api-servers", type=int, default=1, help="API server processes")
    p.add_argument("--repeats", type=int, default=2, help="runs; the cheapest counts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default=None, help="write the API process's cProfile here")
    args = p.parse_args(argv)
    r = measure(args)
    print(f"{'requests':>8} {'tokens':>7} {'wall s':>7} {'API CPU s':>9} {'us/token':>8} "
          f"{'events':>7} {'API CPU share':>13} {'ingest p50/p99 ms':>17} {'TTFT p99 ms':>11}")  # fmt: skip
    print(f"{args.num_requests:>8} {r['tokens']:>7} {r['wall_s']:>7.2f} {r['api_cpu_s']:>9.2f} "
          f"{r['api_us_per_token']:>8.1f} {r['events']:>7} {r['api_cpu_share']:>13.2f} "
          f"{r['ingest_ms']['p50']:>8.0f}/{r['ingest_ms']['p99']:<8.0f} "
          f"{r['ttft_ms']['p99']:>11.0f}")  # fmt: skip
    print(json.dumps({"benchmark": "front_door", **vars(args), **r}))


if __name__ == "__main__":
    main()
