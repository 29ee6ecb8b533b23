"""W2, single-stream decode latency (BENCHMARKS.md): `python -m minisgl.benchmark.latency`.

Batch 1, a 128-token prompt, 256 greedy output tokens (`ignore_eos`), dummy weights of the
Llama-3-8B shape. The scheduler loop runs as the server runs it; a token's time is when it
reaches the host, and the inter-token latency is the gap between consecutive tokens, median and
p99 over `--runs` runs after a warm-up run. The floor (`floor_ms`) is what a token must read at
the copy bandwidth measured in the same run: every weight once in the dtype it is stored in (FP8
at a byte, int4 at half a byte, with their scales) except the input embedding table, of which a
step reads one row, plus the KV of the mean context (`common.ModelBytes`);
`floor_all_params_ms` counts every parameter (16.06 GB for this shape in bf16).
`--quantization fp8|int4|int8` and `--kv-cache-dtype fp8_e4m3` run the quantized engines.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from minisgl.benchmark import common
from minisgl.benchmark.common import Row
from minisgl.core import Req, SamplingParams
from minisgl.llm import LLM

DEFAULT_MODEL = Path(__file__).parent / "models" / "llama-3-8b"


def run_once(llm: LLM, prompt: list[int], output_len: int, rid: str) -> tuple[float, list[float]]:
    """(start time, arrival time of every token) of one request alone in the engine."""
    sched = llm.scheduler
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    sched.add_request(Req(rid=rid, prompt_ids=prompt, params=params, seed=0))
    arrivals: list[float] = []
    start = time.perf_counter()
    while sched.has_work:
        for ev in sched.step():
            arrivals.extend(time.perf_counter() for _ in ev.new_tokens)
    assert len(arrivals) == output_len, f"got {len(arrivals)} tokens, expected {output_len}"
    return start, arrivals


def measure(args: Any, llm: LLM) -> tuple[list[float], list[float]]:
    """Inter-token gaps of `--runs` runs, and each run's time to first token (seconds)."""
    vocab = min(10000, llm.engine.model_config.vocab_size)
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.runs + 1)]
    run_once(llm, prompts[0], min(args.output_len, 32), "warm-up")
    gaps: list[float] = []
    ttft: list[float] = []
    for i, prompt in enumerate(prompts[1:]):
        start, arrivals = run_once(llm, prompt, args.output_len, f"run-{i}")
        ttft.append(arrivals[0] - start)
        gaps += [b - a for a, b in zip(arrivals, arrivals[1:])]
    return gaps, ttft


def _quant_label(quant: Any) -> str | None:
    """fp8, int4 / int8 (online), or the integer checkpoint's format."""
    if quant is None or not quant.is_int:
        return None if quant is None else "fp8"
    return f"int{quant.bits}" if quant.source == "online" else quant.source


def main(argv: Sequence[str] | None = None) -> None:
    p = common.engine_parser(__doc__, DEFAULT_MODEL, load_format="dummy", cuda_graph_max_bs=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    device = common.resolve_device(args.device)
    bandwidth = common.measure_bandwidth(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    context = args.prompt_len + args.output_len + 64
    llm = common.make_llm(args, max_running_requests=4, max_context_len=context)
    gaps, ttft = measure(args, llm)
    engine = llm.engine
    mb = common.ModelBytes.of(engine.model, engine.model_config, engine.pool.dtype)
    mean_context = args.prompt_len + args.output_len / 2
    floor_s = (mb.weights + mean_context * mb.kv_per_token) / bandwidth
    all_params_s = mb.all_params / bandwidth
    median = statistics.median(gaps)
    row: Row = {
        "runs": args.runs,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "median_itl_ms": median * 1e3,
        "p99_itl_ms": common.percentiles(gaps)["p99"] * 1e3,
        "mean_itl_ms": statistics.fmean(gaps) * 1e3,
        "min_itl_ms": min(gaps) * 1e3,
        "ttft_ms": statistics.median(ttft) * 1e3,
        "floor_weight_bytes": mb.weights,
        "floor_kv_bytes": mean_context * mb.kv_per_token,
        "floor_s": floor_s,
        "floor_ms": floor_s * 1e3,
        "fraction_of_floor": floor_s / median,
        "itl_over_floor": median / floor_s,
        "floor_all_params_ms": all_params_s * 1e3,
        "itl_over_all_params_floor": median / all_params_s,
        "tok_per_s": 1 / median,
        "page_size": engine.config.page_size,
        "cuda_graphs": engine.graphs is not None,
        "overlap": llm.scheduler.overlap,
        "kv_cache_dtype": engine.config.kv_cache_dtype,
        "quantization": _quant_label(engine.model_config.quant),
    }
    info = {"workload": "W2", "model": Path(args.model).name, **common.device_info(device)}
    print(f"W2 single-stream decode latency: {info['model']} on {info['device']}, copy "
          f"bandwidth {bandwidth / 1e12:.3f} TB/s")  # fmt: skip
    common.print_pairs("minisgl", row)
    common.emit_json({**info, "bandwidth_bytes_per_s": bandwidth, "measured_s": median, **row})


if __name__ == "__main__":
    main()
