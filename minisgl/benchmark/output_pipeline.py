"""Host time per token of the output pipeline over one long output: does it grow with length?

python -m minisgl.benchmark.output_pipeline              # 2,000 tokens, SmolLM2's tokenizer
python -m minisgl.benchmark.output_pipeline --tokens 8000 --repeat 9

One token per event, as the server's detokenizer sees a decoding request. Variants: the
pipeline alone (`RequestOutput.add`) without and with stop strings (which never match, so every
token is checked) and log-probs; the detokenizer worker's whole step (`Detokenizer.process`:
`TokenOut` in, `StrOut` out). Each token's time is the median over `--repeat` runs; the table
compares the first and the last quarter of the output.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from minisgl.benchmark.common import emit_json, print_table
from minisgl.message import TokenOut
from minisgl.tokenizer.output import OutputOptions, RequestOutput
from minisgl.tokenizer.workers import Detokenizer
from minisgl.weights import load_tokenizer, resolve_source

PROSE = (
    "the sea is wide and deep under a grey sky where waves roll over stones while gulls cry "
    "above boats that drift slowly toward harbour lights café naïve 海 😀 , . ; : ( )"
)
STOPS = ("<<END>>", "\n\n\n\n", "STOP HERE", "Observation:")  # absent from the text


def token_stream(tokenizer: Any, n: int, seed: int = 0) -> list[int]:
    """`n` token ids of prose-like text with punctuation and multi-byte characters."""
    rng = random.Random(seed)
    words = [*PROSE.split(), "\n"]
    ids: list[int] = []
    while len(ids) < n:
        text = " ".join(rng.choice(words) for _ in range(400))
        ids += tokenizer(text)["input_ids"]
    return ids[:n]


Step = Callable[[int, int], object]  # (index, token id) -> anything


def time_per_token(make: Callable[[], Step], ids: list[int], repeat: int) -> list[float]:
    """Seconds per token (the median over `repeat` fresh runs), token by token."""
    runs = []
    for _ in range(repeat):
        step = make()
        times = []
        for i, t in enumerate(ids):
            start = time.perf_counter()
            step(i, t)
            times.append(time.perf_counter() - start)
        runs.append(times)
    return [statistics.median(col) for col in zip(*runs, strict=True)]


def pipeline(tokenizer: Any, n: int, stops: tuple[str, ...], logprobs: bool) -> Step:
    out = RequestOutput(tokenizer, OutputOptions(stop=stops))
    top = [[7, 8, 9, 10, 11]]
    top_lps = [[-0.1, -1.0, -2.0, -3.0, -4.0]]

    def step(i: int, t: int) -> object:
        last = i == n - 1
        reason = "length" if last else None
        if logprobs:
            return out.add([t], last, reason, [-0.5], top, top_lps)
        return out.add([t], last, reason)

    return step


def worker(tokenizer: Any, n: int, stops: tuple[str, ...]) -> Step:
    detok = Detokenizer(tokenizer)

    def step(i: int, t: int) -> object:
        last = i == n - 1
        msg = TokenOut("r", [t], last, "length" if last else None, 16, 0, list(stops), True)
        return detok.process(msg)

    return step


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5, help="runs per variant (median per token)")
    ap.add_argument("--model", default=None, help="whose tokenizer (default: SmolLM2)")
    args = ap.parse_args(argv)
    tokenizer = load_tokenizer(resolve_source(args.model))
    ids = token_stream(tokenizer, args.tokens)
    n, q = len(ids), len(ids) // 4
    variants: dict[str, Callable[[], Step]] = {
        "pipeline": lambda: pipeline(tokenizer, n, (), False),
        "pipeline+stops": lambda: pipeline(tokenizer, n, STOPS, False),
        "pipeline+stops+logprobs": lambda: pipeline(tokenizer, n, STOPS, True),
        "detokenizer worker+stops": lambda: worker(tokenizer, n, STOPS),
    }
    rows = []
    for name, make in variants.items():
        per_token = time_per_token(make, ids, args.repeat)
        first, last = statistics.mean(per_token[:q]), statistics.mean(per_token[-q:])
        rows.append({"variant": name, "first_quarter_us": first * 1e6,
                     "last_quarter_us": last * 1e6, "last_over_first": last / first,
                     "total_ms": sum(per_token) * 1e3})  # fmt: skip
    where = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    print_table(
        f"{n} tokens, one per event, median of {args.repeat} runs per token ({where})", rows
    )
    emit_json({"benchmark": "output_pipeline", "tokens": n, "repeat": args.repeat, "rows": rows})


if __name__ == "__main__":
    main()
