"""W9, structured output (BENCHMARKS.md): `python -m minisgl.benchmark.structured`.

The same requests with and without a JSON-schema constraint, in one run. On a GPU by default:
dummy weights of the Qwen3-0.6B shape with a real 151k vocabulary from a tokenizer-only GGUF
(`--tokenizer`, e.g. llama.cpp's `ggml-vocab-qwen2.gguf`), 64 and 256 concurrent requests; on
the CPU: the embedded SmolLM2-135M-Instruct (its own weights and tokenizer), 16 concurrent.
Prompts are random token ids. Every request runs to `--output-len` tokens (`ignore_eos`, and a
schema that cannot be complete that soon: an object holding an array of at least 100,000
strings), so both runs do the same steps and their periods compare directly.

Per concurrency: output tokens/s of each run, the median period of full decode steps of each
(the targets: constrained <= 1.05x unconstrained on the H200; >= 0.85x tokens/s on the CPU), the
host time per step spent filling token masks, and the share of it the device's work hid (1 -
the extra step period / the fill time; derived, not traced). Prints a table, then one JSON
object as the last line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from minisgl.benchmark.common import Row, device_info, emit_json, print_table, synchronize
from minisgl.benchmark.offline import DEFAULT_MODEL, StepRecorder, TokenIdLLM
from minisgl.core import SamplingParams
from minisgl.llm import LLM

SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string"}, "minItems": 100000}},
    "required": ["items"],
}


class MaskTimer:
    """Host seconds spent filling token masks (wraps the scheduler's `Grammars.mask`)."""

    def __init__(self, llm: LLM) -> None:
        self.grammars = llm.scheduler.grammars
        self.original: Callable[..., Any] = self.grammars.mask
        self.seconds, self.calls = 0.0, 0

    def __enter__(self) -> MaskTimer:
        def timed(reqs: Any, drafts: Any = None) -> Any:
            start = time.perf_counter()
            out = self.original(reqs, drafts)
            self.seconds += time.perf_counter() - start
            self.calls += 1
            return out

        self.grammars.mask = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self.grammars.mask = self.original  # type: ignore[method-assign]


def load_llm(args: argparse.Namespace) -> LLM:
    options: dict[str, Any] = dict(
        dtype=args.dtype,
        device=args.device,
        max_running_requests=max(args.concurrency),
        show_progress=False,
    )
    if args.model is None:  # the embedded SmolLM2, with its tokenizer
        llm = LLM(**options)
    else:
        llm = TokenIdLLM(str(args.model), load_format=args.load_format, **options)
    if args.threads is not None:
        llm.scheduler.grammars.threads = args.threads
    if args.model is None:
        return llm
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    if tokenizer is not None:
        llm.scheduler.grammars.load_tokenizer = lambda: tokenizer
    return llm


def load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path))


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    hi = min(vocab, 30000) - 1  # ordinary tokens, no specials at the end of the vocabulary
    return [[rng.randint(100, hi) for _ in range(length)] for _ in range(n)]


def run_once(llm: LLM, ps: list[list[int]], params: SamplingParams) -> Row:
    device = llm.engine.device
    grammars = llm.scheduler.grammars
    with StepRecorder(llm) as steps, MaskTimer(llm) as masks:
        synchronize(device)
        filled = grammars.fill_seconds
        start = time.perf_counter()
        outs = llm.generate(ps, params, use_tqdm=False)
        synchronize(device)
        seconds = time.perf_counter() - start
        filled = grammars.fill_seconds - filled
    tokens = sum(len(o["token_ids"]) for o in outs)
    assert all(o["finish_reason"] == "length" for o in outs), "every request must run to the end"
    times = [s[0] for s in steps.steps] + [start + seconds]
    full = [
        stop - t0
        for (t0, b, t, _), stop in zip(steps.steps, times[1:])
        if t == b and b == len(ps)  # decode steps of the whole batch
    ]
    return {
        "seconds": seconds,
        "output_tok_per_s": tokens / seconds,
        "decode_step_ms": statistics.median(full) * 1e3 if full else float("nan"),
        "full_decode_steps": len(full),
        # on the fill thread, and what asking for the masks cost the loop
        "mask_fill_ms_per_step": filled / masks.calls * 1e3 if masks.calls else 0.0,
        "mask_loop_ms_per_step": masks.seconds / masks.calls * 1e3 if masks.calls else 0.0,
        "mask_steps": masks.calls,
        "texts": [o["text"] for o in outs[:2]] if outs and outs[0].get("text") else [],
    }


def compare(llm: LLM, n: int, args: argparse.Namespace) -> Row:
    vocab = llm.engine.model_config.vocab_size
    plain = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    schema = SamplingParams(
        max_tokens=args.output_len, temperature=0, ignore_eos=True, json_schema=json.dumps(SCHEMA)
    )
    warm = prompts(n, args.input_len, vocab, seed=1)
    for p in (plain, schema):  # compile the grammar, the kernels and the graphs first
        llm.generate(warm, dataclasses.replace(p, max_tokens=8), use_tqdm=False)
    ps = prompts(n, args.input_len, vocab, seed=2)
    u = run_once(llm, ps, plain)
    ps = prompts(n, args.input_len, vocab, seed=3)  # no prefix-cache hits on the first run's
    c = run_once(llm, ps, schema)
    extra = c["decode_step_ms"] - u["decode_step_ms"]
    on_gpu = llm.engine.device.type == "cuda"
    fill = c["mask_fill_ms_per_step"]
    return {
        "concurrency": n,
        "plain_tok_per_s": u["output_tok_per_s"],
        "schema_tok_per_s": c["output_tok_per_s"],
        "tok_per_s_ratio": c["output_tok_per_s"] / u["output_tok_per_s"],
        "plain_step_ms": u["decode_step_ms"],
        "schema_step_ms": c["decode_step_ms"],
        "step_period_ratio": c["decode_step_ms"] / u["decode_step_ms"],
        "mask_fill_ms_per_step": fill,
        "mask_loop_ms_per_step": c["mask_loop_ms_per_step"],
        # On the CPU the host is the device: nothing can hide the fill there.
        "hidden_share": 1.0 - max(0.0, extra) / fill if fill > 0 and on_gpu else float("nan"),
        "full_decode_steps": c["full_decode_steps"],
        "schema_sample": c["texts"][:1],
    }


def fill_scaling(llm: LLM, rows: Sequence[int], threads: Sequence[int]) -> list[Row]:
    """Host time of one step's masks alone: `rows` matchers of SCHEMA inside a string (the state
    the runs above spend their steps in), filled with each thread count."""
    from minisgl.constrain import MaskFiller, RequestGrammar
    from minisgl.core import Constraint

    grammars = llm.scheduler.grammars
    compiled = grammars.compiler.compile(Constraint("json_schema", json.dumps(SCHEMA)))
    prefix = grammars.load_tokenizer()('{"items": ["hello", "wor', add_special_tokens=False)
    out: list[Row] = []
    for n in rows:
        matchers: list[RequestGrammar | None] = []
        for _ in range(n):
            g = RequestGrammar(compiled, [])
            assert all(g.accept(t) for t in prefix["input_ids"])
            matchers.append(g)
        for k in threads:
            filler = MaskFiller(grammars.vocab_size, k)
            filler.fill(matchers)
            times = []
            for _ in range(10):
                start = time.perf_counter()
                filler.fill(matchers)
                times.append(time.perf_counter() - start)
            ms = statistics.median(times) * 1e3
            out.append({"rows": n, "threads": k, "fill_ms": ms, "us_per_row": ms * 1e3 / n})
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    on_gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", type=Path, default=DEFAULT_MODEL if on_gpu else None,
        help="a model directory or .gguf (default: the Qwen3-0.6B shape on a GPU, SmolLM2 on "
        "the CPU)",
    )  # fmt: skip
    p.add_argument("--load-format", default="dummy", choices=["dummy", "auto"])
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer dir or .gguf")
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 256] if on_gpu else [16])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256 if on_gpu else 32)
    p.add_argument(
        "--threads", type=int, default=None,
        help="mask fill threads of the runs (default: the scheduler's, all cores but two)",
    )  # fmt: skip
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--fill-threads", type=int, nargs="*", default=[1, 4, 8, 14],
        help="thread counts for the mask-fill-only table (none: skip it)",
    )  # fmt: skip
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    llm = load_llm(args)
    info = {"workload": "W9", "model": str(args.model or "SmolLM2-135M-Instruct")}
    info.update(device_info(llm.engine.device))
    print(f"W9 structured output: {info['model']} on {info['device']}; JSON schema vs none, "
          f"{args.input_len} prompt / {args.output_len} output tokens per request")  # fmt: skip
    rows = [compare(llm, n, args) for n in args.concurrency]
    print_table(
        "constrained (JSON schema) vs unconstrained, same requests",
        rows,
        ["concurrency", "plain_tok_per_s", "schema_tok_per_s", "tok_per_s_ratio",
         "plain_step_ms", "schema_step_ms", "step_period_ratio", "mask_fill_ms_per_step",
         "mask_loop_ms_per_step", "hidden_share"],
    )  # fmt: skip
    scaling = fill_scaling(llm, args.concurrency, args.fill_threads) if args.fill_threads else []
    if scaling:
        print_table("one step's masks alone, by fill threads", scaling,
                    ["rows", "threads", "fill_ms", "us_per_row"])  # fmt: skip
    emit_json({**info, "schema": SCHEMA, "rows": rows, "fill_scaling": scaling})


if __name__ == "__main__":
    main()
