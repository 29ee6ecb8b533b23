"""W6: the embedded SmolLM2-135M-Instruct on a CPU, minisgl against transformers in one run.

python -m minisgl.benchmark.cpu [--requests 32] [--dtype auto] [--threads N] [--skip-hf]
    [--single] [--quantization dequantize|int4|int8] [--repeat N]

Batch: 32 requests of 32-256 prompt tokens, 64 greedy output tokens each (ignore_eos), through
`LLM.generate` and through transformers' continuous batching (`generate_batch`) on the same
prompts. Single stream: one 128-token prompt, 64 tokens, `LLM.generate` against `generate`
(`--single`: that alone, the batch skipped). The embedded GGUF serves its projections 4-bit
(`--quantization dequantize`: in fp32, as transformers does).
transformers runs in fp32 (the baseline of the W6 targets) and, when minisgl runs in another
dtype, in that dtype too; speedups are against the same dtype.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

from minisgl import SamplingParams
from minisgl.benchmark import common
from minisgl.benchmark.common import Row
from minisgl.config import DTYPES
from minisgl.weights import default_model_path

_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lens = [rng.randint(32, 256) for _ in range(n)]
    return [[rng.randint(0, 10000) for _ in range(length)] for length in lens]


def run_minisgl(prompts: list[list[int]], single: list[int], out_len: int, args: Any) -> Row:
    llm = common.make_llm(args)
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:4] or [single], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    flush = llm.scheduler.flush_cache  # no prefix reuse from the warm-up or a previous run
    run = lambda: llm.generate(prompts, params, use_tqdm=False)  # noqa: E731
    outs, batch_s = common.best_time(run, args.repeat, flush) if prompts else ([], float("nan"))
    tokens = sum(len(o["token_ids"]) for o in outs)
    one = lambda: llm.generate([single], params, use_tqdm=False)  # noqa: E731
    single_out, single_s = common.best_time(one, args.repeat, flush)
    return _row(llm.engine.config.dtype, tokens, batch_s, len(single_out[0]["token_ids"]), single_s)


def run_hf(
    prompts: list[list[int]], single: list[int], out_len: int, dtype: str, repeat: int
) -> Row:
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
        outs, batch_s = common.best_time(run, repeat) if prompts else ({}, float("nan"))
        tokens = sum(len(o.generated_tokens) for o in outs.values())
        single_out, single_s = common.best_time(
            lambda: model.generate(torch.tensor([single]), generation_config=gen), repeat
        )
    return _row(dtype, tokens, batch_s, single_out.shape[1] - len(single), single_s)


def _row(dtype: str, tokens: int, batch_s: float, single_tokens: int, single_s: float) -> Row:
    return {"dtype": dtype, "batch_tokens": tokens, "batch_s": batch_s,
            "batch_tok_s": tokens / batch_s, "single_tok_s": single_tokens / single_s}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    p = common.engine_parser(__doc__)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--repeat", type=int, default=1, help="best of N timed runs, each side")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--single", action="store_true", help="the single stream only")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = [] if args.single else make_prompts(args.requests)
    single = make_prompts(1, seed=1)[0][:128] + [7] * max(0, 128 - len(make_prompts(1, 1)[0]))
    ours = run_minisgl(prompts, single, args.output_len, args)
    # transformers in fp32 first (the W6 baseline), then in our dtype, for a like-for-like ratio.
    dtypes = [] if args.skip_hf else dict.fromkeys(["float32", ours["dtype"]])
    rows = [{"engine": "minisgl", **ours}]
    rows += [{"engine": "transformers", **run_hf(prompts, single, args.output_len, d, args.repeat)}
             for d in dtypes]  # fmt: skip
    result: Row = {"workload": "W6", "minisgl": ours, "transformers": rows[1:]}
    for r in rows[1:]:
        result[f"speedup_vs_{_SHORT[r['dtype']]}"] = {
            "batch": ours["batch_tok_s"] / r["batch_tok_s"],
            "single": ours["single_tok_s"] / r["single_tok_s"],
        }
    common.print_table(f"W6 CPU ({torch.get_num_threads()} threads, "
                f"{torch.backends.cpu.get_cpu_capability()}), SmolLM2-135M, {args.requests} "
                f"requests x {args.output_len} tokens", rows)  # fmt: skip
    common.print_pairs(
        "minisgl's speedup", {k: v for k, v in result.items() if k.startswith("speedup")}
    )
    common.emit_json(result)


if __name__ == "__main__":
    main()
