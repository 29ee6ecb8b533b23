"""Shared pieces of the engine benchmarks: bandwidth, the roofline floor, tables and the JSON.

The floor (BENCHMARKS.md): a decode step cannot beat (weight bytes + KV bytes read) / memory
bandwidth, counting the bytes as stored: every parameter once per step in its own dtype (FP8
weights at one byte, their fp32 scales included), the LM head included and the input embedding
table excluded (a step reads only its rows) unless it is tied to the LM head; a token decoded at
context length c reads c tokens of KV in the pool's dtype (one byte per value for FP8).
"""

from __future__ import annotations

import gc
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from minisgl.config import ModelConfig

Row = dict[str, Any]


# ---- bandwidth ---------------------------------------------------------------------------------


def measure_bandwidth(device: torch.device) -> float:
    """Bytes/s (read + written) of a large device-to-device copy on `device`."""
    if device.type == "cuda":
        from minisgl.benchmark.bandwidth import measure_copy_bandwidth

        with torch.cuda.device(device):
            return measure_copy_bandwidth(device=str(device))
    return _cpu_copy_bandwidth()


def _cpu_copy_bandwidth(nbytes: int = 256 << 20) -> float:
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times)


# ---- timing ------------------------------------------------------------------------------------


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
    print(f"{label}device time per step {totals['gpu_busy_ms_per_step']:.3f} ms busy, "
          f"{totals['gpu_span_ms_per_step']:.3f} ms span, {totals['kernels_per_step']:.0f} kernels")  # fmt: skip
    for r in rows[:top]:
        print(f"  {r['us_per_step']:8.1f} us (span {r['span_us_per_step']:7.1f}) "
              f"{r['per_step']:6.1f}x  {r['kernel']}")  # fmt: skip


def batch_bucket(batch: int) -> str:
    """The decode-step groups of the per-step tables, by batch size."""
    for lo, hi in ((1, 8), (9, 32), (33, 128), (129, 256)):
        if lo <= batch <= hi:
            return f"decode {lo}-{hi}"
    return "decode >256"


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


# ---- the floor ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelBytes:
    """What one decode step of a model reads, in bytes, each tensor in the dtype it is stored
    in (this rank's shards at tensor parallelism)."""

    weights: int  # per step: every parameter once, LM head included, untied embedding excluded
    all_params: int  # every parameter once, embedding included
    kv_per_token: int  # K and V of one token, all layers, in the KV pool's dtype

    @staticmethod
    def of(model: nn.Module, mcfg: ModelConfig, kv_dtype: torch.dtype) -> ModelBytes:
        weights = everything = 0
        for name, p in model.named_parameters():  # tied parameters are listed once
            nbytes = p.numel() * p.element_size()
            everything += nbytes
            if "embed_tokens" not in name or mcfg.tie_word_embeddings:
                weights += nbytes
        elem = torch.empty((), dtype=kv_dtype).element_size()
        kv = 2 * mcfg.num_layers * mcfg.num_kv_heads * mcfg.head_dim * elem
        return ModelBytes(weights, everything, kv)


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


# ---- output ------------------------------------------------------------------------------------


def add_fp8_args(p: Any) -> None:
    """`--kv-cache-dtype`, `--kv-cache-calibrate`, `--quantization` of the engine benchmarks, and
    the linear layers' kernel switches (`--fp8-gemv-max-rows`, `--fp8-skinny`,
    `--skinny-max-rows`)."""
    from minisgl.config.quant import KV_CACHE_DTYPES, QUANTIZATIONS

    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--kv-cache-calibrate", type=int, default=0, metavar="N",
                   help="FP8 KV scales from N tokens of the built-in text")  # fmt: skip
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS)
    p.add_argument("--fp8-gemv-max-rows", type=int, default=None,
                   help="FP8 linear layers: rows up to which the weight-only GEMV runs")  # fmt: skip
    p.add_argument("--fp8-skinny", action="store_true",
                   help="FP8 weight-only rows take the skinny tensor-core GEMM, not the GEMV")  # fmt: skip
    p.add_argument("--skinny-max-rows", type=int, default=None, metavar="N",
                   help="unquantized linear layers with 2..N rows take the skinny GEMM (0: off; "
                   "default: 16 for models with hidden size <= 1024)")  # fmt: skip
    p.add_argument("--deterministic", action="store_true", help="batch-invariant engine numerics")


def fp8_options(args: Any) -> Row:
    """The engine options `add_fp8_args` set."""
    options: Row = dict(
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_calibrate=args.kv_cache_calibrate,
        quantization=args.quantization,
        deterministic=args.deterministic,
    )
    if args.fp8_gemv_max_rows is not None:
        options["fp8_gemv_max_rows"] = args.fp8_gemv_max_rows
    if args.fp8_skinny:
        options["fp8_skinny"] = True
    if args.skinny_max_rows is not None:
        options["skinny_max_rows"] = args.skinny_max_rows
    return options


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


def fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.4e}"
    return str(v)


def print_table(title: str, rows: Sequence[Row], columns: Sequence[str]) -> None:
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print(f"\n{title}")
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def print_pairs(title: str, pairs: Row) -> None:
    print(f"\n{title}")
    width = max(len(k) for k in pairs)
    for k, v in pairs.items():
        print(f"  {k.ljust(width)}  {fmt(v)}")


def emit_json(result: Row) -> None:
    """The benchmark's last line: one JSON object with every figure."""
    print(json.dumps(result, default=str), flush=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
