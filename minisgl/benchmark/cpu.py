"""W6: the embedded SmolLM2-135M-Instruct on a CPU, minisgl against transformers in one run.

python -m minisgl.benchmark.cpu [--requests 32] [--hf-requests 32] [--threads N]

Batch: 32 requests of 32-256 prompt tokens, 64 greedy output tokens each (ignore_eos), through
`LLM.generate` and through transformers' continuous batching (`generate_batch`) on the same
prompts. Single stream: one 128-token prompt, 64 tokens, `LLM.generate` against `generate`.
Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import torch

from minisgl import LLM, SamplingParams
from minisgl.weights import default_model_path


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lens = [rng.randint(32, 256) for _ in range(n)]
    return [[rng.randint(0, 10000) for _ in range(length)] for length in lens]


def timed(fn: Any) -> tuple[Any, float]:
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def run_minisgl(prompts: list[list[int]], single: list[int], out_len: int) -> dict[str, float]:
    llm = LLM()
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    llm.scheduler.flush_cache()  # no prefix reuse from the warm-up
    outs, batch_s = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    tokens = sum(len(o["token_ids"]) for o in outs)
    llm.scheduler.flush_cache()
    single_out, single_s = timed(lambda: llm.generate([single], params, use_tqdm=False))
    return {
        "batch_tokens": tokens,
        "batch_s": batch_s,
        "batch_tok_s": tokens / batch_s,
        "single_tok_s": len(single_out[0]["token_ids"]) / single_s,
    }


def run_hf(prompts: list[list[int]], single: list[int], out_len: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None
    gen = GenerationConfig(
        max_new_tokens=out_len, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    with torch.inference_mode():
        model.generate(torch.tensor([single[:8]]), generation_config=gen)  # warm-up
        outs, batch_s = timed(lambda: model.generate_batch(prompts, generation_config=gen))
        tokens = sum(len(o.generated_tokens) for o in outs.values())
        single_out, single_s = timed(
            lambda: model.generate(torch.tensor([single]), generation_config=gen)
        )
    return {
        "batch_tokens": tokens,
        "batch_s": batch_s,
        "batch_tok_s": tokens / batch_s,
        "single_tok_s": (single_out.shape[1] - len(single)) / single_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = make_prompts(args.requests)
    single = make_prompts(1, seed=1)[0][:128] + [7] * max(0, 128 - len(make_prompts(1, 1)[0]))
    ours = run_minisgl(prompts, single, args.output_len)
    ref = None if args.skip_hf else run_hf(prompts, single, args.output_len)
    print(
        f"W6 CPU ({torch.get_num_threads()} threads), SmolLM2-135M fp32, "
        f"{args.requests} requests x {args.output_len} tokens"
    )
    print(f"{'engine':<14}{'batch tok/s':>14}{'batch s':>10}{'single tok/s':>15}")
    for name, r in (("minisgl", ours), ("transformers", ref)):
        if r is not None:
            print(
                f"{name:<14}{r['batch_tok_s']:>14.1f}{r['batch_s']:>10.2f}"
                f"{r['single_tok_s']:>15.1f}"
            )
    result: dict[str, Any] = {"workload": "W6", "minisgl": ours, "transformers": ref}
    if ref is not None:
        result["batch_speedup"] = ours["batch_tok_s"] / ref["batch_tok_s"]
        result["single_speedup"] = ours["single_tok_s"] / ref["single_tok_s"]
        print(
            f"speedup: batch {result['batch_speedup']:.1f}x, "
            f"single stream {result['single_speedup']:.1f}x"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
