"""The benchmarks' shared harness: the device and its bandwidth, timers, GPU kernel tables, the
roofline floor, an engine built from `python -m minisgl`'s own flags, tables and the JSON line.

The floor (BENCHMARKS.md): a decode step cannot beat (weight bytes + KV bytes read) / memory
bandwidth, counting the bytes as stored: every parameter once per step in its own dtype (FP8
weights at one byte, their fp32 scales included), the LM head included and the input embedding
table excluded (a step reads only its rows) unless it is tied to the LM head; a token decoded at
context length c reads c tokens of KV in the pool's dtype (one byte per value for FP8).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from minisgl.config import EngineConfig, ModelConfig
from minisgl.config.cli import add_config_flags, cli_fields, config_kwargs
from minisgl.llm import LLM

Row = dict[str, Any]


# ---- device and bandwidth ----------------------------------------------------------------------


def resolve_device(name: str = "auto") -> torch.device:
    return torch.device(name if name != "auto" else "cuda" if torch.cuda.is_available() else "cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_info(device: torch.device) -> Row:
    info: Row = {"device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        info["device"] = torch.cuda.get_device_name(device)
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            pass
    return info


def measure_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes/s (read + written) of a large device-to-device copy on `device`.

    On a GPU a graph-captured `copy_` becomes a DMA memcpy node that runs well below what SM
    loads reach (2.76 against 4.3+ TB/s on an H200), which would make the floor too lenient:
    SM-driven copies (`copy_` and an elementwise kernel) are timed eagerly between CUDA events
    and the faster counts."""
    if device.type != "cuda":
        src = torch.ones(256 << 18, dtype=torch.float32)  # 256 MiB
        dst = torch.empty_like(src)
        _, seconds = best_time(lambda: dst.copy_(src), 5)
        return 2 * src.numel() * 4 / seconds
    with torch.cuda.device(device):
        src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device)
        dst = torch.empty_like(src)
        methods = (lambda: dst.copy_(src), lambda: torch.mul(src, 1, out=dst))
        return max(2 * nbytes / _median_event_seconds(fn) for fn in methods)


def _median_event_seconds(fn: Callable[[], object], iters: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def release_memory() -> None:
    """Give a dropped engine's device memory back (its graphs and caches hold cycles) before
    the next engine sizes its KV pool from what is free."""
    gc.collect()
    if not torch.cuda.is_available():
        return
    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated()
    if held > 1 << 30:
        print(f"warning: {held / 2**30:.1f} GiB still allocated after dropping an engine",
              file=sys.stderr)  # fmt: skip


# ---- timing ------------------------------------------------------------------------------------


@contextlib.contextmanager
def patched(owner: Any, name: str, wrap: Callable[[Any], Any]) -> Iterator[None]:
    """`owner.name` replaced by `wrap(original)` while entered: how a benchmark watches the
    engine's calls (a step's shape, a grammar's tokens) without a hook of its own there."""
    original = getattr(owner, name)
    setattr(owner, name, wrap(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def best_time(fn: Callable[[], Any], repeat: int = 1, before: Callable[[], Any] | None = None
              ) -> tuple[Any, float]:  # fmt: skip
    """fn's last result and its best wall time of `repeat` runs (a shared machine only ever
    slows a run down); `before` runs untimed ahead of each."""
    best, out = math.inf, None
    for _ in range(repeat):
        if before is not None:
            before()
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return out, best


def attempt(label: Row, fn: Callable[..., Row], *args: Any, **kwargs: Any) -> Row:
    """Run one case; one that fails (a tile that does not fit or compile, out of memory, a wrong
    result) becomes an error row labelled `label` instead of ending the run."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # triton and torch raise several unrelated types here
        return {**label, "error": f"{type(e).__name__}: {str(e)[:120]}"}
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def percentiles(values: Sequence[float]) -> dict[str, float]:
    if len(values) < 2:
        v = values[0] if values else float("nan")
        return {"p50": v, "p90": v, "p99": v}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": q[49], "p90": q[89], "p99": q[98]}


def time_graph(
    fn: Callable[[int], object],
    n_sets: int = 1,
    replays: int = 10,
    target_s: float = 2e-3,
    max_calls: int = 1000,
) -> float:
    """Median seconds per call of `fn(i)` (i cycling over range(n_sets)), replayed as one CUDA
    graph of back-to-back calls, the way decode runs: about `target_s` of calls per replay.

    Every set runs eagerly first, which compiles the Triton kernels; the warm-up before the
    capture runs on a side stream, as torch recommends for libraries that set up lazily.
    """
    for i in range(n_sets):
        fn(i)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(0)
    end.record()
    end.synchronize()
    estimate_s = max(start.elapsed_time(end) * 1e-3, 1e-6)
    calls = max(n_sets, min(max_calls, math.ceil(target_s / estimate_s)))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in range(calls):
            fn(c % n_sets)
    graph.replay()
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / calls)
    return statistics.median(times)


# ---- profiles --------------------------------------------------------------------------------------

GPU_EVENT_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def trace_events(prof: Any, keep: str = "") -> list[Row]:
    """The events of a finished torch.profiler run, through its Chrome trace (kept at `keep`).
    Kernels replayed from a CUDA graph appear there as device events, where the profiler's op
    summaries show one cudaGraphLaunch."""
    with tempfile.TemporaryDirectory() as tmp:
        path = keep or str(Path(tmp) / "trace.json")
        prof.export_chrome_trace(path)
        return list(json.loads(Path(path).read_text()).get("traceEvents", []))


def gpu_kernel_table(
    events: Sequence[Row], steps: int, groups: dict[str, Sequence[str]] | None = None
) -> tuple[list[Row], Row]:
    """Trace events -> (one row per GPU kernel name by total time, per-step totals). `groups`:
    name -> kernel-name fragments whose kernels and time per step the totals add up."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_EVENT_CATEGORIES]
    if not gpu:
        raise RuntimeError("the profile holds no GPU kernels (CUPTI unavailable?)")
    durations: dict[str, list[float]] = {}
    # How far each kernel moves the end of the GPU's work (in start order): with PDL a kernel
    # starts early and waits, so its duration overstates it; this is its share of the span.
    advance: dict[str, float] = {}
    frontier = -math.inf
    for e in sorted(gpu, key=lambda e: float(e["ts"])):
        durations.setdefault(str(e["name"]), []).append(float(e["dur"]))  # us
        end = float(e["ts"]) + float(e["dur"])
        step = end - frontier if frontier > -math.inf else float(e["dur"])
        advance[str(e["name"])] = advance.get(str(e["name"]), 0.0) + max(0.0, step)
        frontier = max(frontier, end)
    busy = sum(sum(d) for d in durations.values())
    rows: list[Row] = [
        {"kernel": name if len(name) <= 90 else name[:87] + "...", "calls": len(d),
         "per_step": len(d) / steps, "us_per_step": sum(d) / steps, "mean_us": sum(d) / len(d),
         "share": sum(d) / busy, "span_us_per_step": advance[name] / steps}
        for name, d in durations.items()
    ]  # fmt: skip
    rows.sort(key=lambda r: -r["us_per_step"])
    span = max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)
    totals: Row = {
        "steps": steps,
        "kernels_per_step": len(gpu) / steps,
        "gpu_busy_ms_per_step": busy / steps / 1e3,
        "gpu_span_ms_per_step": span / steps / 1e3,  # busy + the gaps between kernels
        "gpu_idle_share": 1 - busy / span,
    }
    for group, fragments in (groups or {}).items():
        picked = [d for name, d in durations.items() if any(f in name for f in fragments)]
        totals[f"{group}_kernels_per_step"] = sum(len(d) for d in picked) / steps
        totals[f"{group}_ms_per_step"] = sum(sum(d) for d in picked) / steps / 1e3
    return rows, totals


def print_kernel_table(prof: Any, steps: int, label: str = "", top: int = 24) -> None:
    """The top GPU kernels of a finished torch.profiler run of `steps` steps, per step: time,
    how far each moves the end of the device's work (its share of the step's span), count."""
    try:
        rows, totals = gpu_kernel_table(trace_events(prof), steps)
    except RuntimeError as e:  # no GPU kernels: a dry run on the CPU
        print(f"{label}{e}")
        return
    _print_kernels(rows[:top], totals, label)


def profile_steps(step: Callable[[], object], steps: int, label: str = "", keep: str = "",
                  groups: dict[str, Sequence[str]] | None = None, top: int = 24
                  ) -> tuple[list[Row], Row]:  # fmt: skip
    """torch.profiler (device activity only: less overhead) over `steps` calls of `step`: the
    top GPU kernels per step and the totals (`gpu_kernel_table`, the trace kept at `keep`),
    printed and returned, the wall time per step among the totals."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    rows, totals = gpu_kernel_table(trace_events(prof, keep), steps, groups)
    totals["wall_ms_per_step"] = wall / steps * 1e3
    _print_kernels(rows[:top], totals, label)
    return rows[:top], totals


def _print_kernels(rows: Sequence[Row], totals: Row, label: str) -> None:
    print(f"{label}device time per step {totals['gpu_busy_ms_per_step']:.3f} ms busy, "
          f"{totals['gpu_span_ms_per_step']:.3f} ms span, {totals['kernels_per_step']:.0f} kernels")  # fmt: skip
    for r in rows:
        print(f"  {r['us_per_step']:8.1f} us (span {r['span_us_per_step']:7.1f}) "
              f"{r['per_step']:6.1f}x  {r['kernel']}")  # fmt: skip


def batch_bucket(batch: int) -> str:
    """The decode-step groups of the per-step tables, by batch size."""
    for lo, hi in ((1, 8), (9, 32), (33, 128), (129, 256)):
        if lo <= batch <= hi:
            return f"decode {lo}-{hi}"
    return "decode >256"


# ---- the floor ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelBytes:
    """What one decode step of a model reads, in bytes, each tensor in the dtype it is stored
    in (this rank's shards at tensor parallelism)."""

    weights: int  # per step: every parameter once, LM head included, untied embedding excluded
    all_params: int  # every parameter once, embedding included
    kv_per_token: int  # K and V of one token, all layers, in the KV pool's dtype
    experts: int = 0  # of `weights`: the MoE experts' stacks, every layer's
    num_experts: int = 0  # experts per MoE layer

    @staticmethod
    def of(model: nn.Module, mcfg: ModelConfig, kv_dtype: torch.dtype) -> ModelBytes:
        weights = everything = experts = num_experts = 0
        for name, p in model.named_parameters():  # tied parameters are listed once
            nbytes = p.numel() * p.element_size()
            everything += nbytes
            if "embed_tokens" not in name or mcfg.tie_word_embeddings:
                weights += nbytes
            if ".experts." in name:  # [E, ...] stacks
                experts, num_experts = experts + nbytes, p.shape[0]
        elem = torch.empty((), dtype=kv_dtype).element_size()
        kv = 2 * mcfg.num_layers * mcfg.num_kv_heads * mcfg.head_dim * elem
        return ModelBytes(weights, everything, kv, experts, num_experts)


@dataclass(frozen=True)
class Floor:
    weight_bytes: int
    kv_bytes: int
    bandwidth: float  # bytes/s

    @property
    def seconds(self) -> float:
        return (self.weight_bytes + self.kv_bytes) / self.bandwidth

    def as_dict(self) -> Row:
        return {
            "floor_weight_bytes": self.weight_bytes,
            "floor_kv_bytes": self.kv_bytes,
            "floor_s": self.seconds,
        }


def decode_floor(
    prompt_lens: Sequence[int], output_lens: Sequence[int], mb: ModelBytes, bandwidth: float
) -> Floor:
    """Floor of generating `output_lens[i]` tokens after `prompt_lens[i]`, all requests at once.

    Token j (1-based) of a request is produced at context length prompt + j - 1 and reads that
    much KV; the steps number max(output_lens), each reading the weights once.
    """
    kv_tokens = sum(o * p + o * (o - 1) // 2 for p, o in zip(prompt_lens, output_lens))
    steps = max(output_lens, default=0)
    return Floor(steps * mb.weights, kv_tokens * mb.kv_per_token, bandwidth)


# ---- workloads --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """Requests as token ids, each with its output length (and priority)."""

    prompts: list[list[int]]
    output_lens: list[int]
    priorities: list[int] = field(default_factory=list)  # empty: every request's is 0

    @staticmethod
    def draw(
        n: int, seed: int, prompt_range: tuple[int, int], output_range: tuple[int, int]
    ) -> Workload:
        rng = random.Random(seed)
        lens = [rng.randint(*prompt_range) for _ in range(n)]
        prompts = [[rng.randint(0, 9999) for _ in range(k)] for k in lens]
        return Workload(prompts, [rng.randint(*output_range) for _ in range(n)])

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    def priority(self, i: int) -> int:
        return self.priorities[i] if self.priorities else 0

    def with_classes(self, classes: Sequence[int], seed: int) -> Workload:
        """Each request gets one of `classes` as its priority (uniformly, from `seed`)."""
        rng = random.Random(seed + 7919)
        return Workload(self.prompts, self.output_lens, [rng.choice(classes) for _ in self.prompts])

    def head(self, n: int) -> Workload:
        return self.part(range(min(n, len(self.prompts))))

    def part(self, ids: Sequence[int]) -> Workload:
        """Requests `ids` of this workload, in that order."""
        pick = [self.priority(i) for i in ids] if self.priorities else []
        return Workload([self.prompts[i] for i in ids], [self.output_lens[i] for i in ids], pick)


# ---- an engine from the command line ------------------------------------------------------------


class TokenIdLLM(LLM):
    """Token ids in, token ids out: dummy weights write no meaningful text, and config-only
    directories have no tokenizer to look for."""

    @property
    def has_tokenizer(self) -> bool:
        return False


def engine_parser(doc: str | None, model: str | Path | None = None, **defaults: Any
                  ) -> argparse.ArgumentParser:  # fmt: skip
    """A benchmark's parser: its docstring as the description, `--model` and every engine flag
    of `python -m minisgl` (the config's own, grouped as there), plus the kernel switches the
    server leaves at their defaults; `defaults`: the benchmark's own defaults of those flags."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None if model is None else str(model),
                   help=f"model directory, .gguf or hub id (default: {model or 'the embedded SmolLM2'})")  # fmt: skip
    names = dict.fromkeys(f.metadata["group"] for f in cli_fields(EngineConfig))
    add_config_flags({g: p.add_argument_group(f"engine: {g}") for g in names}, EngineConfig)
    k = p.add_argument_group("engine: kernels")
    k.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    k.add_argument("--disable-overlap", action="store_true", help="no overlap scheduling")
    k.add_argument("--fp8-gemv-max-rows", type=int, default=None,
                   help="FP8 linear layers: rows up to which the weight-only GEMV runs")  # fmt: skip
    k.add_argument("--fp8-skinny", action="store_true",
                   help="FP8 weight-only rows take the skinny tensor-core GEMM, not the GEMV")  # fmt: skip
    k.add_argument("--skinny-max-rows", type=int, default=None, metavar="N",
                   help="unquantized linear layers with 2..N rows take the skinny GEMM (0: off; "
                   "default: 16 for models with hidden size <= 1024)")  # fmt: skip
    p.set_defaults(**defaults)
    return p


def add_alias(p: argparse.ArgumentParser, alias: str, flag: str) -> None:
    """`alias` is another name of `flag` (--help lists both)."""
    action = p._option_string_actions[flag]  # argparse's own index of option strings
    action.option_strings = [*action.option_strings, alias]
    p._option_string_actions[alias] = action


def engine_options(args: argparse.Namespace, **extra: Any) -> Row:
    """The `LLM` options that `engine_parser`'s flags set, then `extra`."""
    options: Row = config_kwargs(EngineConfig, args) | {
        "attention_backend": args.attention_backend,
        "overlap": not args.disable_overlap,
        "fp8_skinny": args.fp8_skinny,
        "show_progress": False,
    }
    for name in ("fp8_gemv_max_rows", "skinny_max_rows"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    return options | extra


def make_llm(args: argparse.Namespace, **extra: Any) -> LLM:
    """The engine the flags describe (token ids only with dummy weights)."""
    cls = TokenIdLLM if args.load_format == "dummy" else LLM
    return cls(args.model, **engine_options(args, **extra))


# ---- output ------------------------------------------------------------------------------------


def fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.4e}"
    return str(v)


def print_table(title: str, rows: Sequence[Row], columns: Sequence[str] | None = None) -> None:
    """`rows` under `columns` (default: the first row's keys that are not lists or dicts)."""
    if columns is None:
        columns = [k for k, v in rows[0].items() if not isinstance(v, (list, dict))] if rows else []
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print(f"\n{title}")
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def print_pairs(title: str, pairs: Row) -> None:
    if not pairs:
        return
    print(f"\n{title}")
    width = max(len(k) for k in pairs)
    for k, v in pairs.items():
        print(f"  {k.ljust(width)}  {fmt(v)}")


def emit_json(result: Row) -> None:
    """The benchmark's last line: one JSON object with every figure."""
    print(json.dumps(result, default=str), flush=True)
