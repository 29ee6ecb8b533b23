"""W9, structured output (BENCHMARKS.md): `python -m minisgl.benchmark.structured`.

The same requests without a constraint and with a JSON-schema constraint on each grammar backend
(llguidance, the default, and xgrammar when it is installed), in one run. On a GPU by default:
dummy weights of the Qwen3-0.6B shape with a real 151k vocabulary from a tokenizer-only GGUF
(`--tokenizer`, e.g. llama.cpp's `ggml-vocab-qwen2.gguf`), 64 and 256 concurrent requests; on
the CPU: the embedded SmolLM2-135M-Instruct (its own weights and tokenizer), 16 concurrent.
Prompts are random token ids. Every request runs to `--output-len` tokens (`ignore_eos`, and
schemas that cannot be complete that soon: arrays of at least 100,000 items), so all runs do
the same steps and their periods compare directly. Two modes:

- random: the model's own pick among the allowed tokens (with dummy weights, an arbitrary
  allowed token: the worst case, a new grammar state nearly every step) under an array of
  strings;
- realistic: each constrained row's grammar follows a real JSON document (records of names,
  numbers, flags and tags, written by `json.dumps` and tokenized with the real vocabulary:
  teacher-forced replay, whatever the model sampled under the document's mask).

Per concurrency: output tokens/s of each run, the median period of full decode steps of each
(the targets: realistic constrained <= 1.05x plain, random <= 1.15x at 64 and 1.3x at 256 on an
H100/H200; >= 0.9x tokens/s on the CPU), the host time per step spent filling token masks (and
per row), and the share of it the device's work hid (1 - the extra step period / the fill time;
derived, not traced).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from minisgl.benchmark import common
from minisgl.benchmark.common import Row
from minisgl.benchmark.offline import DEFAULT_MODEL, StepRecorder
from minisgl.core import SamplingParams
from minisgl.llm import LLM

SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string"}, "minItems": 100000}},
    "required": ["items"],
}
RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string"},
        "city": {"type": "string"},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["id", "name", "city", "score", "active", "tags"],
    "additionalProperties": False,
}
REALISTIC = {
    "type": "object",
    "properties": {"records": {"type": "array", "items": RECORD, "minItems": 100000}},
    "required": ["records"],
    "additionalProperties": False,
}
_WORDS = ["Alice Johnson", "Bob Li", "Chen Wei", "Dana Kowalski", "Eve Martin", "Farid Haddad"]
_CITIES = ["London", "Paris", "New York", "São Paulo", "Tokyo", "Lagos", "Zürich"]
_TAGS = ["engineer", "runner", "coffee lover", "open source", "chess", "vegan", "pilot"]
BACKENDS = ("llguidance", "xgrammar")
MODES = ("random", "realistic")


def document(seed: int, chars: int = 6000) -> str:
    """The start of a JSON document of REALISTIC (never complete: more records always fit)."""
    rng = random.Random(seed)
    records: list[str] = []
    while sum(len(r) for r in records) < chars:
        record = {
            "id": rng.randint(1, 99999),
            "name": rng.choice(_WORDS),
            "city": rng.choice(_CITIES),
            "score": round(rng.uniform(0, 100), rng.randint(0, 3)),
            "active": rng.random() < 0.5,
            "tags": rng.sample(_TAGS, rng.randint(0, 3)),
        }
        records.append(json.dumps(record, ensure_ascii=False))
    return '{"records": [' + ", ".join(records)


def replay(llm: LLM, docs: list[list[int]]) -> contextlib.AbstractContextManager[None]:
    """Teacher-forced replay while entered: each constrained request's grammar accepts the
    tokens of a document of its own instead of the ones sampled (the scheduler's
    `Grammars.accept`), so its masks are those of a real document's states."""
    position: dict[str, tuple[list[int], int]] = {}

    def wrap(accept: Callable[..., Any]) -> Callable[..., bool]:
        def forced(req: Any, token: int) -> bool:
            doc, at = position.get(req.rid) or (docs[len(position) % len(docs)], 0)
            position[req.rid] = (doc, at + 1)
            return bool(accept(req, doc[at]))

        return forced

    return common.patched(llm.scheduler.grammars, "accept", wrap)


def load_llm(args: Any) -> LLM:
    llm = common.make_llm(args, max_running_requests=max(args.concurrency))
    if args.threads is not None:
        llm.scheduler.grammars.threads = args.threads
    if args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer)
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


def run_once(
    llm: LLM, ps: list[list[int]], params: SamplingParams, docs: list[list[int]] | None = None
) -> Row:
    """One timed `generate`; with `docs`, constrained rows replay them (`replay`)."""
    device = llm.engine.device
    grammars = llm.scheduler.grammars
    with StepRecorder(llm) as steps:
        forced = replay(llm, docs) if docs else contextlib.nullcontext()
        common.synchronize(device)
        filled = grammars.fill_seconds
        start = time.perf_counter()
        with forced:
            outs = llm.generate(ps, params, use_tqdm=False)
        common.synchronize(device)
        seconds = time.perf_counter() - start
        filled = grammars.fill_seconds - filled
    tokens = sum(len(o["token_ids"]) for o in outs)
    assert all(o["finish_reason"] == "length" for o in outs), "every request must run to the end"
    # the periods of decode steps of the whole batch
    full = [d for d, b, t, _ in steps.periods(start + seconds) if t == b == len(ps)]
    return {
        "seconds": seconds,
        "output_tok_per_s": tokens / seconds,
        "rows": len(ps),
        "decode_step_ms": statistics.median(full) * 1e3 if full else float("nan"),
        "full_decode_steps": len(full),
        # on the fill threads (wall time), per step (every step of a constrained run masks)
        "mask_fill_ms_per_step": filled / len(steps.steps) * 1e3 if filled else 0.0,
    }


def compare(llm: LLM, n: int, args: Any, backends: Sequence[str]) -> list[Row]:
    """Plain, then each backend in each mode, on the same prompts' shapes (fresh prompts each run:
    no prefix-cache hits on another run's)."""
    vocab = llm.engine.model_config.vocab_size
    tokenizer = llm.scheduler.grammars.load_tokenizer()
    docs = [tokenizer(document(i), add_special_tokens=False)["input_ids"] for i in range(8)]
    assert min(len(d) for d in docs) > args.output_len + 8, "documents too short"
    plain = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    schemas = {"random": SCHEMA, "realistic": REALISTIC}
    seed = 10
    warm = prompts(n, args.input_len, vocab, seed=1)
    llm.generate(warm, dataclasses.replace(plain, max_tokens=8), use_tqdm=False)
    u = run_once(llm, prompts(n, args.input_len, vocab, seed=2), plain)
    rows = [{"concurrency": n, "run": "plain", **_figures(u, u, llm)}]
    for backend in backends:
        llm.scheduler.grammars.use_backend(backend)
        for mode in MODES:
            p = dataclasses.replace(plain, json_schema=json.dumps(schemas[mode]))
            llm.generate(warm, dataclasses.replace(p, max_tokens=8), use_tqdm=False)  # compile
            seed += 1
            ps = prompts(n, args.input_len, vocab, seed=seed)
            c = run_once(llm, ps, p, docs if mode == "realistic" else None)
            rows.append({"concurrency": n, "run": f"{backend} {mode}", **_figures(c, u, llm)})
    llm.scheduler.grammars.use_backend(BACKENDS[0])
    return rows


def _figures(c: Row, u: Row, llm: LLM) -> Row:
    extra = c["decode_step_ms"] - u["decode_step_ms"]
    on_gpu = llm.engine.device.type == "cuda"
    fill = c["mask_fill_ms_per_step"]
    return {
        "tok_per_s": c["output_tok_per_s"],
        "tok_per_s_ratio": c["output_tok_per_s"] / u["output_tok_per_s"],
        "step_ms": c["decode_step_ms"],
        "step_period_ratio": c["decode_step_ms"] / u["decode_step_ms"],
        "mask_fill_ms_per_step": fill,
        "fill_us_per_row": fill * 1e3 / c["rows"],
        # On the CPU the host is the device: nothing can hide the fill there.
        "hidden_share": 1.0 - max(0.0, extra) / fill if fill > 0 and on_gpu else float("nan"),
        "full_decode_steps": c["full_decode_steps"],
    }


def available(backends: Sequence[str]) -> list[str]:
    import importlib.util

    return [b for b in backends if importlib.util.find_spec(b) is not None]


def main(argv: Sequence[str] | None = None) -> None:
    on_gpu = torch.cuda.is_available()
    # GPU: the Qwen3-0.6B shape (dummy weights); CPU: the embedded SmolLM2 (its own weights)
    p = common.engine_parser(__doc__, DEFAULT_MODEL if on_gpu else None,
                      load_format="dummy" if on_gpu else "auto")  # fmt: skip
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer dir or .gguf")
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 256] if on_gpu else [16])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256 if on_gpu else 32)
    p.add_argument("--threads", type=int, default=None,
                   help="mask fill threads (default: the scheduler's, all cores but two)")  # fmt: skip
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    args = p.parse_args(argv)
    llm = load_llm(args)
    backends = available(args.backends)
    info = {"workload": "W9", "model": str(args.model or "SmolLM2-135M-Instruct")}
    info.update(common.device_info(llm.engine.device))
    print(f"W9 structured output: {info['model']} on {info['device']}; JSON schema on "
          f"{', '.join(backends)} vs none, {args.input_len} prompt / {args.output_len} output "
          "tokens per request")  # fmt: skip
    rows = [r for n in args.concurrency for r in compare(llm, n, args, backends)]
    common.print_table("plain vs constrained (each backend, each mode), same request shapes", rows)
    common.emit_json({**info, "schemas": {"random": SCHEMA, "realistic": REALISTIC}, "rows": rows})


if __name__ == "__main__":
    main()
