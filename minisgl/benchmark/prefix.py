"""W5, shared-prefix throughput: `--cache radix` against `--cache naive` in one run.

python -m minisgl.benchmark.prefix            # CPU variant: SmolLM2, 32 x (1024 shared + 32)
python -m minisgl.benchmark.prefix --gpu      # GPU variant: 128 x (2048 shared + 64), 64 out
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from minisgl import SamplingParams
from minisgl.benchmark.common import Row, emit_json, engine_parser, make_llm, print_table


def workload(n: int, shared: int, own: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randint(0, 10000) for _ in range(shared)]
    return [prefix + [rng.randint(0, 10000) for _ in range(own)] for _ in range(n)]


def run(args: Any, cache: str, prompts: list[list[int]], out_len: int) -> Row:
    llm = make_llm(args, cache=cache)
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    llm.generate([prompts[0][-64:]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    llm.scheduler.flush_cache()
    before = llm.scheduler.stats["computed_prompt_tokens"]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    return {
        "cache": cache,
        "seconds": seconds,
        "output_tok_s": sum(len(o["token_ids"]) for o in outs) / seconds,
        "requests_s": len(prompts) / seconds,
        "cached_token_share": sum(o["cached_tokens"] for o in outs) / sum(map(len, prompts)),
        "computed_prompt_tokens": llm.scheduler.stats["computed_prompt_tokens"] - before,
    }


def main(argv: Sequence[str] | None = None) -> None:
    p = engine_parser(__doc__)
    p.add_argument("--gpu", action="store_true", help="the GPU variant of W5 (dummy Qwen3-8B)")
    args = p.parse_args(argv)
    n, shared, own, out = (128, 2048, 64, 64) if args.gpu else (32, 1024, 32, 16)
    if args.gpu and args.model is None:
        args.model, args.load_format = str(Path(__file__).parent / "models" / "qwen3-8b"), "dummy"
    prompts = workload(n, shared, own)
    rows = [run(args, c, prompts, out) for c in ("radix", "naive")]
    speedup = rows[0]["output_tok_s"] / rows[1]["output_tok_s"]
    print_table(f"W5 shared prefix: {n} requests x ({shared} shared + {own} own) tokens, {out} "
                f"out; radix / naive throughput {speedup:.2f}x", rows)  # fmt: skip
    emit_json({"workload": "W5", "rows": rows, "radix_over_naive": speedup})


if __name__ == "__main__":
    main()
