"""W5: shared-prefix throughput, `--cache radix` against `--cache naive` in one run.

python -m minisgl.benchmark.prefix            # CPU variant: SmolLM2, 32 x (1024 shared + 32)
python -m minisgl.benchmark.prefix --gpu      # GPU variant: 128 x (2048 shared + 64), 64 out

Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

from minisgl import LLM, SamplingParams


def workload(n: int, shared: int, own: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randint(0, 10000) for _ in range(shared)]
    return [prefix + [rng.randint(0, 10000) for _ in range(own)] for _ in range(n)]


def run(cache: str, prompts: list[list[int]], out_len: int, options: dict[str, Any]) -> dict:
    llm = LLM(options.pop("model", None), cache=cache, **options)
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    llm.generate([prompts[0][-64:]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    llm.scheduler.flush_cache()
    before = dict(llm.scheduler.stats)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    tokens = sum(len(o["token_ids"]) for o in outs)
    prompt_tokens = sum(len(p) for p in prompts)
    cached = sum(o["cached_tokens"] for o in outs)
    computed = llm.scheduler.stats["computed_prompt_tokens"] - before["computed_prompt_tokens"]
    return {
        "cache": cache,
        "seconds": seconds,
        "output_tok_s": tokens / seconds,
        "requests_s": len(prompts) / seconds,
        "cached_token_share": cached / prompt_tokens,
        "computed_prompt_tokens": computed,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true", help="the GPU variant of W5")
    ap.add_argument("--model", default=None, help="default: SmolLM2 (CPU) / dummy Qwen3-8B")
    ap.add_argument("--load-format", default="auto")
    args = ap.parse_args()
    if args.gpu:
        n, shared, own, out = 128, 2048, 64, 64
        model = args.model or "minisgl/benchmark/models/qwen3-8b"
        options: dict[str, Any] = {"model": model, "load_format": "dummy"}
    else:
        n, shared, own, out = 32, 1024, 32, 16
        options = {"model": args.model, "load_format": args.load_format}
    prompts = workload(n, shared, own)
    rows = [run(c, prompts, out, dict(options)) for c in ("radix", "naive")]
    print(f"W5 shared prefix: {n} requests x ({shared} shared + {own} own) tokens, {out} out")
    print(
        f"{'cache':<8}{'seconds':>10}{'out tok/s':>12}{'req/s':>8}{'cached share':>14}"
        f"{'computed':>10}"
    )
    for r in rows:
        print(
            f"{r['cache']:<8}{r['seconds']:>10.2f}{r['output_tok_s']:>12.1f}"
            f"{r['requests_s']:>8.2f}{r['cached_token_share']:>14.3f}"
            f"{r['computed_prompt_tokens']:>10}"
        )
    speedup = rows[0]["output_tok_s"] / rows[1]["output_tok_s"]
    print(f"radix / naive throughput: {speedup:.2f}x")
    print(json.dumps({"workload": "W5", "rows": rows, "radix_over_naive": speedup}))


if __name__ == "__main__":
    main()
