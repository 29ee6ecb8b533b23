"""W6: the embedded SmolLM2-135M-Instruct on a CPU, minisgl against transformers in one run.

python -m minisgl.benchmark.cpu [--requests 32] [--dtype auto] [--threads N] [--skip-hf]
    [--single] [--quantization dequantize|int4|int8]

Batch: 32 requests of 32-256 prompt tokens, 64 greedy output tokens each (ignore_eos), through
`LLM.generate` and through transformers' continuous batching (`generate_batch`) on the same
prompts. Single stream: one 128-token prompt, 64 tokens, `LLM.generate` against `generate`
(`--single`: that alone, the batch skipped). The embedded GGUF serves its projections 4-bit
(`--quantization dequantize`: in fp32, as transformers does).
transformers runs in fp32 (the baseline of the W6 targets) and, when minisgl runs in another
dtype, in that dtype too; speedups are against the same dtype. Prints a table, then one JSON
object as the last line.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import torch

from minisgl import LLM, SamplingParams
from minisgl.config import DTYPES
from minisgl.weights import default_model_path

_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lens = [rng.randint(32, 256) for _ in range(n)]
    return [[rng.randint(0, 10000) for _ in range(length)] for length in lens]


def timed(fn: Any, repeat: int = 1, before: Any = None) -> tuple[Any, float]:
    """fn's result and its best time of `repeat` runs (a shared machine only ever slows a run
    down); `before` runs untimed ahead of each."""
    best, out = float("inf"), None
    for _ in range(repeat):
        if before is not None:
            before()
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return out, best


def run_minisgl(
    prompts: list[list[int]], single: list[int], out_len: int, args: argparse.Namespace
) -> dict[str, Any]:
    llm = LLM(dtype=args.dtype, quantization=args.quantization)
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:4] or [single], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    flush = llm.scheduler.flush_cache  # no prefix reuse from the warm-up or a previous run
    run = lambda: llm.generate(prompts, params, use_tqdm=False)  # noqa: E731
    outs, batch_s = timed(run, args.repeat, flush) if prompts else ([], float("nan"))
    tokens = sum(len(o["token_ids"]) for o in outs)
    one = lambda: llm.generate([single], params, use_tqdm=False)  # noqa: E731
    single_out, single_s = timed(one, args.repeat, flush)
    return {
        "dtype": llm.engine.config.dtype,
        "batch_tokens": tokens,
        "batch_s": batch_s,
        "batch_tok_s": tokens / batch_s,
        "single_tok_s": len(single_out[0]["token_ids"]) / single_s,
    }


def run_hf(
    prompts: list[list[int]], single: list[int], out_len: int, dtype: str, repeat: int
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=DTYPES[dtype]
    ).eval()
    model.generation_config.eos_token_id = None
    gen = GenerationConfig(
        max_new_tokens=out_len, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    with torch.inference_mode():
        model.generate(torch.tensor([single[:8]]), generation_config=gen)  # warm-up
        run = lambda: model.generate_batch(prompts, generation_config=gen)  # noqa: E731
        outs, batch_s = timed(run, repeat) if prompts else ({}, float("nan"))
        tokens = sum(len(o.generated_tokens) for o in outs.values())
        single_out, single_s = timed(
            lambda: model.generate(torch.tensor([single]), generation_config=gen), repeat
        )
    return {
        "dtype": dtype,
        "batch_tokens": tokens,
        "batch_s": batch_s,
        "batch_tok_s": tokens / batch_s,
        "single_tok_s": (single_out.shape[1] - len(single)) / single_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--repeat", type=int, default=1, help="best of N timed runs, each side")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--single", action="store_true", help="the single stream only")
    ap.add_argument("--quantization", default=None, choices=["dequantize", "int4", "int8"])
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = [] if args.single else make_prompts(args.requests)
    single = make_prompts(1, seed=1)[0][:128] + [7] * max(0, 128 - len(make_prompts(1, 1)[0]))
    ours = run_minisgl(prompts, single, args.output_len, args)
    refs: list[dict[str, Any]] = []
    if not args.skip_hf:
        # fp32 first: the W6 baseline; then our dtype, for a like-for-like ratio.
        for dtype in dict.fromkeys(["float32", ours["dtype"]]):
            refs.append(run_hf(prompts, single, args.output_len, dtype, args.repeat))
    print(
        f"W6 CPU ({torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}), "
        f"SmolLM2-135M, {args.requests} requests x {args.output_len} tokens"
    )
    print(f"{'engine':<20}{'batch tok/s':>14}{'batch s':>10}{'single tok/s':>15}")
    for name, r in [("minisgl", ours)] + [("transformers", r) for r in refs]:
        label = f"{name} {_SHORT[r['dtype']]}"
        print(
            f"{label:<20}{r['batch_tok_s']:>14.1f}{r['batch_s']:>10.2f}{r['single_tok_s']:>15.1f}"
        )
    result: dict[str, Any] = {"workload": "W6", "minisgl": ours, "transformers": refs}
    for r in refs:
        key = _SHORT[r["dtype"]]
        speedup = {
            "batch": ours["batch_tok_s"] / r["batch_tok_s"],
            "single": ours["single_tok_s"] / r["single_tok_s"],
        }
        result[f"speedup_vs_{key}"] = speedup
        print(
            f"speedup vs transformers {key}: batch {speedup['batch']:.1f}x, "
            f"single stream {speedup['single']:.1f}x"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
