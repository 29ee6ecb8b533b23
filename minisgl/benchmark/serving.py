"""W4, online serving (BENCHMARKS.md): `python -m minisgl.benchmark.serving`.

The default SmolLM2 on a CPU; on a GPU a config-only model directory with `--load-format dummy`
(e.g. `minisgl/benchmark/models/qwen3-0.6b`), served with a synthetic word-level tokenizer of
its vocabulary (token i is the word "t<i>"), and `--mem-fraction` below 0.5 so that the offline
engine fits beside the server (`scripts/gpu_serving.sh` runs it there). `random.Random(seed)`
draws every prompt's length (32-256 tokens), then its token ids, then every output length
(16-96); temperature 0.6 with a per-request seed, `ignore_eos`. In one run: the offline engine
(`LLM.generate` on every prompt at once, the throughput the server should approach) and a
server process fed by the `openai` client, streaming, with Poisson arrivals at each rate (`inf`:
all at once). The offline and saturated runs alternate `--repeats` times, the best of each
counting; the prefix cache is emptied before every run.

Reports request throughput, output tokens/s, TTFT, inter-token latency and time per output
token (p50/p90/p99), and `server_vs_offline` (target >= 0.85). ITL comes from the chunks at the
client (`itl_ms`) and from the server's own token times (`itl_server_ms`, the table's); TTFT is
split into the client's delay before its HTTP stack sends (`client_delay_ms`), the wire and the
API's ingest (`ingest_ms`) and the server's part (`ttft_server_ms`); the API processes' CPU per
streamed token is sampled from /proc. `--short-requests` is the short-request mode (many small
requests, where the API's cost per request shows). `--itl-targets auto,0` runs a server per
latency target; `--priority-classes 0,1` reports TTFT and ITL per class; `--url` measures a
running server; `--dataset` takes ShareGPT-style prompts; `--plot` draws ITL and TTFT curves.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from minisgl.benchmark.common import Workload, emit_json, percentiles, print_table
from minisgl.benchmark.datasets import sharegpt_requests
from minisgl.benchmark.plots import plot_latencies
from minisgl.weights import load_tokenizer, resolve_source

DEFAULT_RATES = ("1", "2", "4", "inf")
# `--short-requests`: many short requests, where the API's cost per request shows.
SHORT_MODE: dict[str, Any] = {
    "num_requests": 2000,
    "prompt_len": (128, 128),
    "output_len": (16, 16),
    "max_in_flight": 512,
    "rates": "inf",
}


TEMPERATURE = 0.6


# ---- offline ---------------------------------------------------------------------------------


def load_offline(model: str | None, options: dict[str, Any]) -> Any:
    from minisgl import LLM, SamplingParams

    llm = LLM(model, **options)
    warm = Workload.draw(4, 1000, (16, 32), (4, 4))
    llm.generate(warm.prompts, SamplingParams(max_tokens=4), use_tqdm=False)
    return llm


def run_offline(llm: Any, work: Workload) -> dict[str, float]:
    from minisgl import SamplingParams

    llm.scheduler.flush_cache()  # start cold, like the server runs
    params = [
        SamplingParams(max_tokens=m, temperature=TEMPERATURE, seed=i, ignore_eos=True)
        for i, m in enumerate(work.output_lens)
    ]
    start = time.perf_counter()
    outs = llm.generate(work.prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o["token_ids"]) for o in outs)
    return {
        "seconds": seconds,
        "output_tokens": tokens,
        "output_tok_s": tokens / seconds,
        "request_s": len(outs) / seconds,
    }


# ---- online ----------------------------------------------------------------------------------


@dataclass
class RequestTrace:
    sent: float
    priority: int = 0
    first: float | None = None
    chunks: list[float] = field(default_factory=list)
    done: float = 0.0
    completion_tokens: int = 0
    server_times: list[float] = field(default_factory=list)  # when the scheduler had each token
    received: float | None = None  # when the server's API took the request (its clock)
    # When the client's HTTP stack sent the request (time.time(), the server's clock on one
    # host): the client's own delay is wire - sent (perf_counter), the server's ingest
    # received - wire.
    wire: float | None = None
    sent_epoch: float = 0.0


TRACE_HEADER = "x-minisgl-bench-trace"


async def open_stream(
    client: Any, prompt: list[int], max_tokens: int, seed: int, priority: int = 0
) -> Any:
    """One streamed `/v1/completions` request of the workload (token ids in, usage with the
    server's token times at the end); its seed, in a header, names it to `wire_times`."""
    return await client.completions.create(
        model="default",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=TEMPERATURE,
        seed=seed,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_times": True, "priority": priority},
        extra_headers={TRACE_HEADER: str(seed)},
    )


def wire_times(times: dict[str, float]) -> Any:
    """An httpx client whose request hook notes in `times` (request seed -> time.time()) when
    each benchmark request leaves for the wire."""
    import httpx

    async def note(request: httpx.Request) -> None:
        key = request.headers.get(TRACE_HEADER)
        if key is not None:
            times[key] = time.time()

    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    return httpx.AsyncClient(event_hooks={"request": [note]}, timeout=3600, limits=limits)


async def one_request(
    client: Any,
    prompt: list[int],
    max_tokens: int,
    seed: int,
    sent: float,
    priority: int = 0,
    sent_epoch: float = 0.0,
) -> RequestTrace:
    trace = RequestTrace(sent, priority, sent_epoch=sent_epoch)
    stream = await open_stream(client, prompt, max_tokens, seed, priority)
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].text:
            trace.first = trace.first or now
            trace.chunks.append(now)
        if chunk.usage is not None:
            trace.completion_tokens = chunk.usage.completion_tokens
            times = getattr(chunk.usage, "token_times", None)  # an extension field
            trace.server_times = list(times[0]) if times else []
            trace.received = getattr(chunk.usage, "received_at", None)
    trace.done = time.perf_counter()
    return trace


async def run_rate(
    url: str,
    work: Workload,
    rate: float,
    seed: int,
    ids: Sequence[int] | None = None,
    start_at: float | None = None,
    in_flight: int = 0,
) -> list[RequestTrace]:
    """Send `work` (request i with seed `ids[i]`, default i) at `rate` requests/s (Poisson
    arrivals; inf: all at once), from `start_at` (a perf_counter time) if given; `in_flight`:
    at most that many requests at once (0: no limit), each sent as soon as a slot frees."""
    import openai

    rng = random.Random(seed)
    slots = asyncio.Semaphore(in_flight or len(work.prompts) or 1)
    ids = range(len(work.prompts)) if ids is None else ids
    wired: dict[str, float] = {}
    client = openai.AsyncOpenAI(
        base_url=f"{url}/v1",
        api_key=os.environ.get(ENV_OPENAI_KEY) or "none",
        max_retries=0,
        timeout=3600,
        http_client=wire_times(wired),
    )
    tasks = []
    async with client:
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        for k, (i, prompt, m) in enumerate(zip(ids, work.prompts, work.output_lens, strict=True)):
            await slots.acquire()
            sent, epoch, priority = time.perf_counter(), time.time(), work.priority(k)
            request = one_request(client, prompt, m, i, sent, priority, epoch)
            tasks.append(asyncio.create_task(request))
            tasks[-1].add_done_callback(lambda _: slots.release())
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
        traces = list(await asyncio.gather(*tasks))
    for i, t in zip(ids, traces):
        t.wire = wired.get(str(i))
    return traces


def _client_part(
    url: str,
    work: Workload,
    rate: float,
    seed: int,
    ids: list[int],
    start_at: float,
    in_flight: int = 0,
) -> list[RequestTrace]:
    try:
        return asyncio.run(run_rate(url, work, rate, seed, ids, start_at, in_flight))
    except Exception as e:
        # The openai client's errors do not unpickle in the parent, and a Pool whose result
        # cannot be unpickled waits forever: send a plain one.
        raise RuntimeError(f"a client process failed: {type(e).__name__}: {e}") from None


def run_clients(
    url: str, work: Workload, rate: float, seed: int, procs: int, in_flight: int = 0
) -> list[RequestTrace]:
    """`run_rate` from `procs` client processes, each with every procs-th request and a
    procs-th of the rate (together still Poisson at `rate`) and of `in_flight`: one Python
    process parsing every streamed chunk is itself the bottleneck of a fast server. Traces in
    request order."""
    if procs <= 1:
        return asyncio.run(run_rate(url, work, rate, seed, in_flight=in_flight))
    import multiprocessing

    n = len(work.prompts)
    parts = [list(range(k, n, procs)) for k in range(procs)]
    start_at = time.perf_counter() + 3.0  # CLOCK_MONOTONIC: one clock for every process
    share = -(-in_flight // procs)
    args = [
        (url, work.part(ids), rate / procs, seed + k, ids, start_at, share)
        for k, ids in enumerate(parts)
    ]
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        results = pool.starmap(_client_part, args)
    traces: list[RequestTrace | None] = [None] * n
    for ids, part in zip(parts, results, strict=True):
        for i, trace in zip(ids, part, strict=True):
            traces[i] = trace
    return [t for t in traces if t is not None]


def latencies(traces: list[RequestTrace]) -> dict[str, dict[str, float]]:
    """TTFT (at the client, and on the server's clock from its API taking the request to the
    first token), inter-token latency (client chunks, and the server's token times) and time per
    output token of `traces`, in milliseconds."""
    ttft = [(t.first - t.sent) * 1e3 for t in traces if t.first is not None]
    ttft_server = [
        (t.server_times[0] - t.received) * 1e3 for t in traces if t.server_times and t.received
    ]
    # A TTFT's parts before the server's: the client's own delay, then the wire and the API's
    # ingest (HTTP parsing, validation, its event loop's queue) up to the handler.
    wired = [t for t in traces if t.wire is not None]
    client_delay = [(t.wire - t.sent_epoch) * 1e3 for t in wired]  # type: ignore[operator]
    ingest = [(t.received - t.wire) * 1e3 for t in wired if t.received]  # type: ignore[operator]
    itl = [(b - a) * 1e3 for t in traces for a, b in zip(t.chunks, t.chunks[1:])]
    gaps = [(b - a) * 1e3 for t in traces for a, b in zip(t.server_times, t.server_times[1:])]
    tpot = [
        (t.done - t.first) * 1e3 / (t.completion_tokens - 1)
        for t in traces
        if t.first is not None and t.completion_tokens > 1
    ]
    return {
        "ttft_ms": percentiles(ttft),
        "ttft_server_ms": percentiles(ttft_server),
        "client_delay_ms": percentiles(client_delay),
        "ingest_ms": percentiles(ingest),
        "itl_ms": percentiles(itl),
        "itl_server_ms": percentiles(gaps),
        "tpot_ms": percentiles(tpot),
    }


def summarize(traces: list[RequestTrace], work: Workload) -> dict[str, Any]:
    start = min(t.sent for t in traces)
    seconds = max(t.done for t in traces) - start
    tokens = sum(t.completion_tokens for t in traces)
    # ignore_eos: every request must stream exactly its max_tokens (a short or lost one counts)
    short = sum(t.completion_tokens != m for t, m in zip(traces, work.output_lens, strict=True))
    # Every token has a server time: a missing one would skew the server's ITL.
    untimed = sum(len(t.server_times) != t.completion_tokens for t in traces)
    summary: dict[str, Any] = {
        "seconds": seconds,
        "requests": len(traces),
        "incomplete": short,
        "untimed": untimed,
        "output_tokens": tokens,
        "request_s": len(traces) / seconds,
        "output_tok_s": tokens / seconds,
        **latencies(traces),
    }
    classes = sorted({t.priority for t in traces})
    if len(classes) > 1:
        summary["by_priority"] = {
            str(p): {"requests": sum(t.priority == p for t in traces)}
            | latencies([t for t in traces if t.priority == p])
            for p in classes
        }
    return summary


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> str | None:
    """Poll `url`/health until it answers 200 (None), the process exits or `timeout` passes
    (a reason)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"the server exited with code {proc.returncode}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return f"the server was not ready in {timeout} s"


class ServerProcess:
    """`python -m minisgl` on a free port, for the duration of a `with` block."""

    def __init__(self, model: str | None, log_path: str, extra: Sequence[str] = ()) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        argv = [sys.executable, "-m", "minisgl", "--port", str(self.port), "--log-level", "warning"]
        if model:
            argv += ["--model", model]
        argv += extra
        self.log_path = log_path
        with open(log_path, "wb") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 600) -> None:
        why = wait_healthy(self.url, self.proc, timeout)
        if why is not None:
            raise RuntimeError(f"{why}; see {self.log_path}")

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(60)


# The key the clients send (`--api-key` sets it; the client processes inherit it).
ENV_OPENAI_KEY = "OPENAI_API_KEY"


def auth_headers() -> dict[str, str]:
    key = os.environ.get(ENV_OPENAI_KEY)
    return {"Authorization": f"Bearer {key}"} if key else {}


def flush_cache(url: str, timeout: float = 60) -> None:
    """Empty the server's prefix cache, retrying while requests of a previous run (aborted
    clients) are still in flight."""
    import httpx

    deadline = time.monotonic() + timeout
    post = partial(httpx.post, f"{url}/flush_cache", timeout=timeout, headers=auth_headers())
    while (r := post()).status_code == 400:
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    r.raise_for_status()


# The scheduler's running totals in /metrics that a run's `server` entry reports (their change).
SERVER_TOTALS = {
    "retractions": "minisgl_retractions",
    "steps_timed": "minisgl_steps_timed",
    "step_measured_s": 'minisgl_step_time_seconds{kind="measured"}',
    "step_predicted_s": 'minisgl_step_time_seconds{kind="predicted"}',
    "step_abs_error_s": 'minisgl_step_time_seconds{kind="abs_error"}',
}


def server_totals(url: str) -> dict[str, float]:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30, headers=auth_headers()).text
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line[:1] not in ("#", ""))
    return {key: float(values.get(name, 0.0)) for key, name in SERVER_TOTALS.items()}


def _proc_stat(pid: int) -> tuple[str, float]:
    """A process's name and its user + system CPU seconds so far (Linux)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    name, rest = text[text.index("(") + 1 :].rsplit(")", 1)
    fields = rest.split()
    return name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def api_cpu_seconds(pid: int | None) -> float | None:
    """CPU seconds the HTTP side of the server at `pid` has used: the launcher's own and its
    API server processes' (`minisgl:api*`); None without a pid or /proc."""
    if pid is None or not Path(f"/proc/{pid}").exists():
        return None
    total, todo = _proc_stat(pid)[1], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            with contextlib.suppress(OSError, ValueError):
                for child in (int(c) for c in (task / "children").read_text().split()):
                    todo.append(child)
                    name, cpu = _proc_stat(child)
                    total += cpu if name.startswith("minisgl:api") else 0.0
    return total


@dataclass(frozen=True)
class Clients:
    """How the requests are sent: from `procs` processes, at most `in_flight` at once (0: no
    limit); `server_pid`: the server's launcher, whose API processes' CPU is reported."""

    procs: int = 1
    in_flight: int = 0
    server_pid: int | None = None


def run_online(
    work: Workload, url: str, rate: float, seed: int, clients: Clients = Clients()
) -> dict[str, Any]:
    """The run's summary, with the change of the server's totals under `server` and every
    request's server token times under `token_times` ([priority, t0, t1, ...] each: for plots;
    `report` takes them out of its JSON line)."""
    flush_cache(url)
    before, cpu = server_totals(url), api_cpu_seconds(clients.server_pid)
    traces = run_clients(url, work, rate, seed, clients.procs, clients.in_flight)
    after, cpu_after = server_totals(url), api_cpu_seconds(clients.server_pid)
    summary = summarize(traces, work)
    if cpu is not None and cpu_after is not None:
        # The HTTP side's cost per streamed token (parsing requests included).
        summary["api_cpu_s"] = cpu_after - cpu
        summary["api_us_per_token"] = (cpu_after - cpu) / summary["output_tokens"] * 1e6
    return summary | {
        "server": {k: after[k] - before[k] for k in after},
        "token_times": [[t.priority, *t.server_times] for t in traces],
        "ttft_each_ms": [(t.first - t.sent) * 1e3 for t in traces if t.first],
    }


def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return max(runs, key=lambda r: float(r["output_tok_s"]))


def measure(
    work: Workload,
    url: str,
    llm: Any,
    rates: list[float],
    repeats: int,
    seed: int,
    clients: Clients = Clients(),
) -> tuple[list[dict[str, float]], dict[str, Any], list[dict[str, Any]]]:
    """Offline and saturated runs alternating, then every finite rate once."""
    warm = Workload.draw(4, seed + 1000, (16, 32), (4, 4))
    asyncio.run(run_rate(url, warm, float("inf"), seed))
    offline_runs, saturated_runs = [], []
    for _ in range(repeats):
        if llm is not None:
            offline_runs.append(run_offline(llm, work))
        saturated_runs.append(run_online(work, url, float("inf"), seed, clients))
    online: dict[str, Any] = {"inf": best(saturated_runs)}
    for rate in (r for r in rates if r != float("inf")):
        online[str(rate)] = run_online(work, url, rate, seed, clients)
    return offline_runs, online, saturated_runs


# ---- report ----------------------------------------------------------------------------------


def table_rows(offline: dict[str, Any] | None, online: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per rate (and priority class), then the offline run; latencies as p50/p90/p99."""

    def trio(p: dict[str, float], digits: int = 0) -> str:
        return "/".join(f"{p[k]:.{digits}f}" for k in ("p50", "p90", "p99"))

    def row(label: str, s: dict[str, Any]) -> dict[str, Any]:
        return {"rate": label, "req/s": s.get("request_s", ""), "out tok/s": s.get("output_tok_s", ""),
                "TTFT ms": trio(s["ttft_ms"]), "client delay": trio(s["client_delay_ms"]),
                "ingest": trio(s["ingest_ms"]), "server TTFT": trio(s["ttft_server_ms"]),
                "server ITL ms": trio(s["itl_server_ms"], 1), "TPOT p50": s["tpot_ms"]["p50"]}  # fmt: skip

    rows = []
    for rate, s in online.items():
        rows += [row(rate, s)] + [row(f"prio {p}", c) for p, c in s.get("by_priority", {}).items()]
    if offline is not None:
        rows.append({"rate": "offline", "req/s": offline["request_s"],
                     "out tok/s": offline["output_tok_s"]})  # fmt: skip
    return rows


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def needs_synthetic_tokenizer(model: str | None, load_format: str) -> bool:
    if model is None or load_format != "dummy" or not Path(model).is_dir():
        return False
    return not any((Path(model) / name).exists() for name in TOKENIZER_FILES)


def synthetic_tokenizer_model(model: str, directory: Path) -> str:
    """A copy of the config-only model directory `model` in `directory`, with a word-level
    tokenizer of the config's vocabulary: token i is the word "t<i>", the end of sequence the
    config's first EOS id. Decoding joins words with spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = json.loads((Path(model) / "config.json").read_text())
    vocab = {f"t{i}": i for i in range(int(config["vocab_size"]))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    eos = config.get("eos_token_id", 0)
    eos = eos[0] if isinstance(eos, list) else eos
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": f"t{eos}"}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    shutil.copy(Path(model) / "config.json", directory / "config.json")
    return str(directory)


def parse_range(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split("-"))
    return lo, hi


# fmt: off
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--model", default=None, help="default: the embedded SmolLM2")
    add("--load-format", default="auto", choices=["auto", "dummy"])
    add("--num-requests", type=int, default=48)
    add("--prompt-len", type=parse_range, default=(32, 256), help="lo-hi tokens")
    add("--output-len", type=parse_range, default=(16, 96), help="lo-hi tokens")
    add("--rates", default=",".join(DEFAULT_RATES),
        help="requests/s, comma-separated; inf: all at once")
    add("--seed", type=int, default=0)
    add("--url", default=None, help="measure this running server instead of starting one")
    add("--api-key", default=os.environ.get(ENV_OPENAI_KEY),
        help=f"the key of a server started with one (default: ${ENV_OPENAI_KEY})")
    add("--dataset", default=None, metavar="SHAREGPT_JSON",
        help="prompts from this ShareGPT-style file (the first human turn; the reply's length, "
        "within --output-len, sets max_tokens)")
    add("--plot", default=None, metavar="PNG",
        help="draw the ITL and TTFT distributions of every rate here (needs matplotlib)")
    add("--skip-offline", action="store_true")
    add("--repeats", type=int, default=2,
        help="alternating offline / saturated runs (the best counts)")
    add("--server-log", default="minisgl-bench-server.log")
    add("--client-procs", type=int, default=1,
        help="client processes sending the requests (one Python client tops out near 10k "
        "streamed tokens/s; a GPU server needs several)")
    add("--mem-fraction", type=float, default=None,
        help="the server's share of the GPU's memory (the offline engine then loads after it)")
    add("--itl-targets", default=None,
        help="--itl-target-ms values, comma-separated (e.g. auto,0): a server each, reported "
        "under by_itl_target")
    add("--priority-classes", default=None,
        help="priorities, comma-separated (e.g. 0,1): each request gets one, the server runs "
        "--schedule-policy priority, TTFT and ITL per class")
    add("--server-args", default="", help="more flags for the server, e.g. '--num-pages 4000'")
    add("--token-times-out", default=None, metavar="PATH",
        help="write every request's server token times here (JSON: {itl target: {rate: "
        "[[priority, t0, t1, ...], ...]}})")
    add("--max-in-flight", type=int, default=0, help="requests at once at most; 0: no limit")
    add("--short-requests", action="store_true",
        help="the short-request mode: " + ", ".join(f"{k} {v}" for k, v in SHORT_MODE.items()))
    args = p.parse_args(argv)
    if args.short_requests:
        vars(args).update(SHORT_MODE)
    if args.url and args.itl_targets:
        p.error("--itl-targets starts servers of its own; leave --url out")
    return args
# fmt: on


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.api_key:
        os.environ[ENV_OPENAI_KEY] = args.api_key
    work = Workload.draw(args.num_requests, args.seed, args.prompt_len, args.output_len)
    if args.dataset:
        tokenizer = load_tokenizer(resolve_source(args.model))
        prompts, output_lens = sharegpt_requests(
            args.dataset, args.num_requests, args.seed, tokenizer, args.output_len,
            args.prompt_len[1],
        )  # fmt: skip
        work = Workload(prompts, output_lens)
    if args.priority_classes:
        work = work.with_classes([int(c) for c in args.priority_classes.split(",")], args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if needs_synthetic_tokenizer(model, args.load_format):
            model = synthetic_tokenizer_model(model, Path(tmp))
            print(f"{args.model} has no tokenizer: a synthetic one of its vocabulary in {model}")
        by_target = run_targets(args, model, work)
    offline_runs = [r for runs in by_target.values() for r in runs[0]]
    offline = best(offline_runs) if offline_runs else None
    _, online, saturated_runs = next(iter(by_target.values()))
    others = {t: runs[1] for t, runs in by_target.items()} if len(by_target) > 1 else None
    report(args, work, offline, online, offline_runs, saturated_runs, others)


Runs = tuple[list[dict[str, float]], dict[str, Any], list[dict[str, Any]]]


def run_targets(args: argparse.Namespace, model: str | None, work: Workload) -> dict[str, Runs]:
    """`measure` against a server per `--itl-targets` value (one server with its own default
    when none is given), or against `--url`."""
    rates = [float(r) for r in args.rates.split(",")]
    options: dict[str, Any] = {"load_format": args.load_format}
    extra = ["--load-format", args.load_format, *shlex.split(args.server_args)]
    if args.mem_fraction is not None:
        extra += ["--mem-fraction", str(args.mem_fraction)]
    if args.priority_classes:
        extra += ["--schedule-policy", "priority"]
    llm = None

    def load() -> Any:
        return None if args.skip_offline else load_offline(model, options)

    def run(url: str, pid: int | None = None) -> Runs:
        clients = Clients(args.client_procs, args.max_in_flight, pid)
        return measure(work, url, llm, rates, args.repeats, args.seed, clients)

    if args.url:
        llm = load()
        return {"server": run(args.url)}
    out = {}
    targets = args.itl_targets.split(",") if args.itl_targets else ["default"]
    for i, target in enumerate(targets):
        flags = extra if target == "default" else [*extra, "--itl-target-ms", target]
        log = args.server_log if target == "default" else f"{args.server_log}.{target}"
        with ServerProcess(model, log, flags) as server:
            # On a CPU the offline engine loads while the first server does; on a GPU after
            # the last one is ready (each sizes its KV pool from the memory left, and the
            # offline engine's is not given back). Neither runs while the other is measured
            # (both sit idle between their runs).
            if i == 0 and args.mem_fraction is None:
                llm = load()
            server.wait_ready()
            if i == len(targets) - 1 and llm is None:
                llm = load()
            out[target] = run(server.url, server.proc.pid)
    return out


def report(
    args: argparse.Namespace,
    work: Workload,
    offline: dict[str, Any] | None,
    online: dict[str, Any],
    offline_runs: list[dict[str, float]],
    saturated_runs: list[dict[str, Any]],
    by_target: dict[str, dict[str, Any]] | None = None,
) -> None:
    """`online`: the first server's runs; `by_target`: every server's, by ITL target."""
    servers = by_target or {"default": online}
    if args.plot:  # every rate of every server
        label = "" if by_target is None else "{} "
        plot_latencies({f"{label.format(t)}rate {r}": s for t, rates in servers.items()
                        for r, s in rates.items()}, args.plot)  # fmt: skip
    times = {
        t: {r: s.pop("token_times", []) for r, s in rates.items()} for t, rates in servers.items()
    }
    for summary in (*online.values(), *saturated_runs):
        summary.pop("token_times", None)
        summary.pop("ttft_each_ms", None)
    if args.token_times_out:
        Path(args.token_times_out).write_text(json.dumps(times))
    for target, rates in servers.items():
        print_table(
            f"W4 online serving{f', --itl-target-ms {target}' if by_target else ''}",
            table_rows(offline, rates),
        )
        for rate, s in rates.items():
            srv, steps = s.get("server", {}), s.get("server", {}).get("steps_timed")
            print(f"rate {rate}: {s['incomplete']} requests short of their tokens"
                  + (f"; {srv['retractions']:.0f} retractions; step period "
                     f"{srv['step_measured_s'] / steps * 1e3:.2f} ms, predicted "
                     f"{srv['step_predicted_s'] / steps * 1e3:.2f} ms" if steps else ""))  # fmt: skip
    sat = online["inf"]
    ratio = sat["output_tok_s"] / offline["output_tok_s"] if offline else None
    if offline is not None:
        print(f"server at saturation / offline: {ratio:.3f} (target >= 0.85; best of "
              f"{args.repeats} alternating runs each); requests/s {sat['request_s']:.1f} against "
              f"{offline['request_s']:.1f} offline")  # fmt: skip
    if "api_us_per_token" in sat:
        print(f"API processes at saturation: {sat['api_cpu_s']:.2f} CPU s, "
              f"{sat['api_us_per_token']:.1f} us per streamed token")  # fmt: skip
    keys = ("load_format", "num_requests", "client_procs", "max_in_flight", "priority_classes",
            "server_args")  # fmt: skip
    result = {"workload": "W4", "model": args.model or "SmolLM2-135M-Instruct",
              **{k: getattr(args, k) for k in keys},
              "prompt_tokens": sum(len(x) for x in work.prompts), "output_tokens": work.output_tokens,
              "offline": offline, "online": online, "server_vs_offline": ratio,
              "offline_runs_tok_s": [r["output_tok_s"] for r in offline_runs],
              "saturated_runs_tok_s": [r["output_tok_s"] for r in saturated_runs]}  # fmt: skip
    if by_target is not None:
        result["by_itl_target"] = by_target
    emit_json(result)


if __name__ == "__main__":
    main()
