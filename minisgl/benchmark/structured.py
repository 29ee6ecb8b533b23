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
H100/H200; >= 0.9x tokens/s on the CPU), the host time per step spent filling token masks, the
share of it the device's work hid (1 - the extra step period / the fill time; derived, not
traced), and the scheduler loop's own time per constrained row (`LoopTimer`). Then one step's masks alone per backend (microseconds per row, by rows and threads, in
both modes). Prints tables, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
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

from minisgl.benchmark.common import Row, device_info, emit_json, print_table, synchronize
from minisgl.benchmark.offline import DEFAULT_MODEL, StepRecorder, TokenIdLLM
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
LOOP_FIGURES = ("loop_us_per_row", "note_us_per_row", "mask_us_per_row", "wait_us_per_row",
                "apply_us_per_row", "wait_ms_per_step")  # fmt: skip


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


class Replay:
    """Teacher-forced replay: each constrained request's grammar accepts the tokens of a
    document of its own instead of the ones sampled (wraps the scheduler's `Grammars.accept`),
    so its masks are those of a real document's states."""

    def __init__(self, llm: LLM, docs: list[list[int]]) -> None:
        self.grammars = llm.scheduler.grammars
        self.original: Callable[..., Any] = self.grammars.accept
        self.docs = docs
        self.position: dict[str, tuple[list[int], int]] = {}

    def __enter__(self) -> Replay:
        def accept(req: Any, token: int) -> bool:
            doc, at = self.position.get(req.rid) or (
                self.docs[len(self.position) % len(self.docs)],
                0,
            )
            self.position[req.rid] = (doc, at + 1)
            return bool(self.original(req, doc[at]))

        self.grammars.accept = accept  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self.grammars.accept = self.original  # type: ignore[method-assign]


class LoopTimer:
    """The scheduler loop's own time in the grammar path, summed over a run: noting each row's
    token (`Grammars.accept`), asking for a step's mask (`Grammars.mask`), waiting for it
    (`TokenMask.to`) and applying it (`sampler.apply_token_mask`: launches on a GPU, the
    device's work itself on the CPU). Thread CPU time of the loop (another process's load does
    not inflate it; a wait costs none), except the per-row notes: wall time there (a call of
    under a microsecond, which the clock of thread CPU time, a system call of about 1.4 us,
    would swamp). The wait's wall time is kept too: the fill the loop could not hide."""

    def __init__(self, llm: LLM) -> None:
        from minisgl.engine import sampler
        from minisgl.engine.step import TokenMask

        grammars = llm.scheduler.grammars
        self.targets: list[tuple[Any, str, str]] = [
            (grammars, "accept", "note"),
            (grammars, "mask", "mask"),
            (TokenMask, "to", "wait"),
            (sampler, "apply_token_mask", "apply"),
        ]
        self.cpu = dict.fromkeys(("note", "mask", "wait", "apply"), 0.0)
        self.wait_wall = 0.0
        self.steps = 0
        self.originals: list[Any] = []

    def __enter__(self) -> LoopTimer:
        for owner, name, key in self.targets:
            original = getattr(owner, name)
            self.originals.append(original)
            setattr(owner, name, self._timed(original, key))
        return self

    def _timed(self, original: Callable[..., Any], key: str) -> Callable[..., Any]:
        if key == "note":

            def note(*args: Any) -> Any:
                start = time.perf_counter()
                try:
                    return original(*args)
                finally:
                    self.cpu[key] += time.perf_counter() - start

            return note

        def timed(*args: Any) -> Any:
            cpu, wall = time.thread_time(), time.perf_counter()
            try:
                return original(*args)
            finally:
                self.cpu[key] += time.thread_time() - cpu
                if key == "wait":
                    self.wait_wall += time.perf_counter() - wall
                self.steps += key == "mask"

        return timed

    def __exit__(self, *exc: object) -> None:
        for (owner, name, _), original in zip(self.targets, self.originals):
            setattr(owner, name, original)

    def figures(self, rows: int) -> Row:
        """Microseconds per constrained row and step (`rows` of them each step), and the wait's
        wall time per step (NaN without a constrained step)."""
        if not self.steps:
            return {**dict.fromkeys(LOOP_FIGURES, float("nan")), "mask_steps": 0}
        per = 1e6 / self.steps / rows
        return {
            "loop_us_per_row": sum(v for k, v in self.cpu.items() if k != "apply") * per,
            **{f"{k}_us_per_row": v * per for k, v in self.cpu.items()},
            "wait_ms_per_step": self.wait_wall / self.steps * 1e3,
            "mask_steps": self.steps,
        }


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


def run_once(
    llm: LLM, ps: list[list[int]], params: SamplingParams, docs: list[list[int]] | None = None
) -> Row:
    """One timed `generate`; with `docs`, constrained rows replay them (`Replay`, inside the
    loop's timer: its own bookkeeping is not counted)."""
    device = llm.engine.device
    grammars = llm.scheduler.grammars
    with StepRecorder(llm) as steps, LoopTimer(llm) as loop:
        replay = Replay(llm, docs) if docs else contextlib.nullcontext()
        synchronize(device)
        filled = grammars.fill_seconds
        start = time.perf_counter()
        with replay:
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
        # on the fill thread (wall time), and what the constrained rows cost the loop
        "mask_fill_ms_per_step": filled / loop.steps * 1e3 if loop.steps else 0.0,
        **loop.figures(len(ps)),
        "texts": [o["text"] for o in outs[:2]] if outs and outs[0].get("text") else [],
    }


def compare(llm: LLM, n: int, args: argparse.Namespace, backends: Sequence[str]) -> list[Row]:
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
        **{k: c[k] for k in LOOP_FIGURES},
        # On the CPU the host is the device: nothing can hide the fill there.
        "hidden_share": 1.0 - max(0.0, extra) / fill if fill > 0 and on_gpu else float("nan"),
        "full_decode_steps": c["full_decode_steps"],
    }


def fill_table(
    llm: LLM, backends: Sequence[str], rows: Sequence[int], threads: Sequence[int], steps: int = 24
) -> list[Row]:
    """Host time of one step's masks alone, per backend and mode: `rows` matchers (random: inside
    a string of SCHEMA, the state the random runs spend their steps in; realistic: each at its own
    place in a document of REALISTIC, advanced by the document's next token after each fill, whose
    time is `accept_us_per_row`), filled with each thread count; wall time, and CPU time of the
    whole process (a measure that another process's load on the host does not inflate)."""
    from minisgl.constrain import GrammarCompiler, MaskFiller, RequestGrammar
    from minisgl.core import Constraint

    grammars = llm.scheduler.grammars
    tokenizer = grammars.load_tokenizer()
    string = tokenizer('{"items": ["hello", "wor', add_special_tokens=False)["input_ids"]
    docs = [tokenizer(document(i), add_special_tokens=False)["input_ids"] for i in range(8)]
    out: list[Row] = []
    for backend in backends:
        compiler = GrammarCompiler(grammars.load_tokenizer, grammars.vocab_size, backend=backend)
        for mode, schema in (("random", SCHEMA), ("realistic", REALISTIC)):
            compiled = compiler.compile(Constraint("json_schema", json.dumps(schema)))
            # As a served grammar's: the states a document passes through met once before.
            warm, one = (
                RequestGrammar(compiled, [compiled.backend.end_token]),
                MaskFiller(grammars.vocab_size, 1),
            )
            for t in docs[0][:400] if mode == "realistic" else string:
                one.fill([warm])
                assert warm.accept(t)
            for n in rows:
                for k in threads:
                    filler = MaskFiller(grammars.vocab_size, k)
                    gs = [RequestGrammar(compiled, [compiled.backend.end_token]) for _ in range(n)]
                    where = [(docs[i % len(docs)], (7 * i) % 200) for i in range(n)]
                    for g, (doc, at) in zip(gs, where):
                        assert all(g.accept(t) for t in (string if mode == "random" else doc[:at]))
                    fill_s = accept_s = cpu_s = 0.0
                    for step in range(steps):
                        start, cpu = time.perf_counter(), time.process_time()
                        filler.fill(gs)
                        fill_s += time.perf_counter() - start
                        cpu_s += time.process_time() - cpu
                        if mode == "realistic":
                            start = time.perf_counter()
                            filler.accept([(g, d[at + step]) for g, (d, at) in zip(gs, where)])
                            accept_s += time.perf_counter() - start
                    assert not any(g.failed for g in gs)
                    out.append({
                        "backend": backend, "mode": mode, "rows": n, "threads": k,
                        "fill_us_per_row": fill_s / steps / n * 1e6,
                        "fill_cpu_us_per_row": cpu_s / steps / n * 1e6,
                        "accept_us_per_row": accept_s / steps / n * 1e6,
                    })  # fmt: skip
        compiler.close()
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
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--fill-only", action="store_true", help="only the masks-alone table")
    p.add_argument(
        "--fill-threads", type=int, nargs="*", default=[1, 4, 8, 14],
        help="thread counts for the mask-fill-only table (none: skip it)",
    )  # fmt: skip
    return p.parse_args(argv)


def available(backends: Sequence[str]) -> list[str]:
    import importlib.util

    return [b for b in backends if importlib.util.find_spec(b) is not None]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    llm = load_llm(args)
    backends = available(args.backends)
    info = {"workload": "W9", "model": str(args.model or "SmolLM2-135M-Instruct")}
    info.update(device_info(llm.engine.device))
    print(f"W9 structured output: {info['model']} on {info['device']}; JSON schema on "
          f"{', '.join(backends)} vs none, {args.input_len} prompt / {args.output_len} output "
          "tokens per request")  # fmt: skip
    runs = [] if args.fill_only else args.concurrency
    rows = [r for n in runs for r in compare(llm, n, args, backends)]
    if rows:
        print_table("plain vs constrained (each backend, each mode), same request shapes", rows,
                    ["concurrency", "run", "tok_per_s", "tok_per_s_ratio", "step_ms",
                     "step_period_ratio", "mask_fill_ms_per_step", "hidden_share"])  # fmt: skip
        print_table(
            "the loop's own time per constrained row and step (us; thread CPU time), "
            "and its wait for the fill",
            rows,
            ["concurrency", "run", *LOOP_FIGURES],
        )
    table = (
        fill_table(llm, backends, args.concurrency, args.fill_threads) if args.fill_threads else []
    )
    if table:
        print_table("one step's masks alone, by backend, mode, rows and threads", table,
                    ["backend", "mode", "rows", "threads", "fill_us_per_row",
                     "fill_cpu_us_per_row", "accept_us_per_row"])  # fmt: skip
    emit_json({**info, "schemas": {"random": SCHEMA, "realistic": REALISTIC}, "rows": rows,
               "fill_table": table})  # fmt: skip


if __name__ == "__main__":
    main()
