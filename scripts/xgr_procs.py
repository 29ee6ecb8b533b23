"""Issue 19 probe: does filling token masks in several processes scale where xgrammar's batch
matcher (threads) does not? W9's schema and state (rows inside a JSON string), a tokenizer from a
GGUF (the 151k Qwen2 vocabulary on the GPU host). For each row count and process count P, P forked
workers each hold rows/P matchers and fill their rows of one shared-memory mask on a signal; the
parent times a whole round (signal, fill, replies). Threads of the batch matcher for comparison.

    python scripts/xgr_procs.py --tokenizer .gguf/ggml-vocab-qwen2.gguf --rows 64 256
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from minisgl.benchmark.structured import SCHEMA, load_tokenizer
from minisgl.constrain import GrammarCompiler, MaskFiller, RequestGrammar
from minisgl.constrain.matcher import bitmask_width
from minisgl.core import Constraint


def build(tokenizer: Any, vocab: int, n: int) -> list[RequestGrammar | None]:
    compiler = GrammarCompiler(lambda: tokenizer, vocab)
    compiled = compiler.compile(Constraint("json_schema", json.dumps(SCHEMA)))
    prefix = tokenizer('{"items": ["hello", "wor', add_special_tokens=False)["input_ids"]
    out: list[RequestGrammar | None] = []
    for _ in range(n):
        g = RequestGrammar(compiled, [])
        assert all(g.accept(t) for t in prefix)
        out.append(g)
    return out


def worker(conn: Any, tokenizer: Any, vocab: int, lo: int, hi: int, bits: torch.Tensor) -> None:
    grammars = build(tokenizer, vocab, hi - lo)
    filler = MaskFiller(vocab, 1)
    view = bits[lo:hi]
    conn.send("ready")
    while conn.recv() == "go":
        filler.fill_into(view, grammars)
        conn.send("done")


def procs_round(rows: int, procs: int, tokenizer: Any, vocab: int, reps: int) -> float:
    ctx = mp.get_context("fork")
    bits = torch.zeros(rows, bitmask_width(vocab), dtype=torch.int32).share_memory_()
    bounds = [rows * i // procs for i in range(procs + 1)]
    pipes, workers = [], []
    for i in range(procs):
        parent, child = ctx.Pipe()
        p = ctx.Process(
            target=worker, args=(child, tokenizer, vocab, bounds[i], bounds[i + 1], bits)
        )
        p.start()
        pipes.append(parent)
        workers.append(p)
    for c in pipes:
        assert c.recv() == "ready"
    times = []
    for _ in range(reps + 2):
        start = time.perf_counter()
        for c in pipes:
            c.send("go")
        for c in pipes:
            c.recv()
        times.append(time.perf_counter() - start)
    for c in pipes:
        c.send("stop")
    for p in workers:
        p.join()
    return statistics.median(times[2:]) * 1e3


def threads_round(rows: int, threads: int, tokenizer: Any, vocab: int, reps: int) -> float:
    grammars = build(tokenizer, vocab, rows)
    filler = MaskFiller(vocab, threads)
    times = []
    for _ in range(reps + 2):
        start = time.perf_counter()
        filler.fill(grammars)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4, 8, 14])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    vocab = len(tokenizer)
    print(f"vocab {vocab}, cores {mp.cpu_count()}")
    print(f"{'rows':>5} {'P':>3} {'threads ms':>11} {'procs ms':>9}")
    for rows in args.rows:
        for p in args.procs:
            t = threads_round(rows, p, tokenizer, vocab, args.reps)
            q = procs_round(rows, p, tokenizer, vocab, args.reps)
            print(f"{rows:5d} {p:3d} {t:11.2f} {q:9.2f}", flush=True)


if __name__ == "__main__":
    main()
