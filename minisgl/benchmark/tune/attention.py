"""Tuners of the attention kernels on one CUDA GPU, on W3's cases (`minisgl.benchmark.kernels`,
whose cases, timers and error checks they use): decode tiles and split counts (`DecodeConfig`,
`default_decode_config`), extend tiles (`ExtendConfig`), the mixed kernel's tiles
(`MixedConfig`)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import torch

from minisgl.benchmark.common import Row, measure_bandwidth, print_table
from minisgl.benchmark.kernels import (
    DECODE_COLUMNS,
    EXTEND_COLUMNS,
    MIXED_COLUMNS,
    MIXED_SHAPES,
    measure_matmul_rate,
    run_decode,
    run_extend,
    run_mixed,
)
from minisgl.benchmark.tune import fastest, search

# (batch, context, spread): W3's shapes, and W1's decode steps (ragged: contexts drawn from
# [1 - spread, 1 + spread] x the mean) of the 129-256 running requests and of the tail.
DECODE_SHAPES = ((256, 4096, 0.0), (256, 1024, 0.0), (32, 4096, 0.0), (1, 32768, 0.0),
                 (200, 820, 0.32), (80, 1250, 0.6), (48, 1400, 0.5))  # fmt: skip
SPLIT_SHAPES = ((1, 4096), (1, 32768), (32, 1024), (32, 4096), (256, 1024))
CUDA = torch.device("cuda")


def tune_decode(page_size: int, kv_dtype: torch.dtype) -> list[Row]:
    """Keys per step x warps x pipeline stages at every DECODE_SHAPES shape (e4m3 pools: half
    the bytes, larger steps), then split counts at SPLIT_SHAPES with the default tiles."""
    from minisgl.kernels.attention.decode import DecodeConfig

    copy_bw = measure_bandwidth(CUDA)
    fp8 = kv_dtype == torch.float8_e4m3fn

    def tiles(case: tuple[Any, ...]) -> Row:
        (b, ctx, spread), bn, w, st = case
        cfg = DecodeConfig(block_n=bn, block_n_unsplit=bn, num_warps=w, num_stages=st)
        return run_decode(b, ctx, page_size, copy_bw, config=cfg, spread=spread, kv_dtype=kv_dtype)

    def splits(case: tuple[Any, ...]) -> Row:
        (b, ctx), n = case
        return run_decode(b, ctx, page_size, copy_bw, num_splits=n, kv_dtype=kv_dtype)

    def label(case: tuple[Any, ...]) -> Row:
        return {"batch": case[0][0], "context": case[0][1], "config": case[1:]}

    sweep = itertools.product(DECODE_SHAPES, (64, 128, 256) if fp8 else (32, 64, 128), (4, 8),
                              range(2, 6 if fp8 else 5))  # fmt: skip
    split_cases = [(s, n) for s, n in itertools.product(SPLIT_SHAPES, (1, 2, 4, 8, 16, 32, 64))
                   if n * 128 <= s[1]]  # fmt: skip
    rows = search(sweep, tiles, "time_us", label) + search(split_cases, splits, "time_us", label)
    # A broken variant is off by O(1); e4m3 rounding stays far below 0.2.
    ok = [r for r in rows if r.get("rel_err", math.inf) < 0.2 or "error" in r]
    print_table("tune: decode", ok, DECODE_COLUMNS)
    best = fastest(ok, "time_us", ("batch", "context"))
    print_table("tune: decode, the fastest per shape", best, DECODE_COLUMNS)
    return rows


def tune_extend(page_size: int, kv_dtype: torch.dtype) -> list[Row]:
    from minisgl.kernels.attention.extend import ExtendConfig

    rate = measure_matmul_rate()

    def run(case: tuple[Any, ...]) -> Row:
        (r, n, c), cfg = case
        return run_extend(r, n, c, page_size, rate, config=cfg, kv_dtype=kv_dtype)

    configs = [ExtendConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
               for bm, bn, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))]  # fmt: skip
    cases = itertools.product(((1, 8192, 0), (16, 1024, 2048)), configs)
    rows = search(cases, run, "time_us",
                  lambda c: {"requests": c[0][0], **dataclasses.asdict(c[1])})  # fmt: skip
    print_table("tune: extend", rows, EXTEND_COLUMNS)
    best = fastest(rows, "time_us", ("requests",))
    print_table("tune: extend, the fastest per shape", best, EXTEND_COLUMNS)
    return rows


def tune_mixed(page_size: int, kv_dtype: torch.dtype, max_requests: int) -> list[Row]:
    """The mixed kernel's tiles at two W4-like steps (num_splits 1)."""
    from minisgl.kernels.attention.mixed import MixedConfig

    copy_bw = measure_bandwidth(CUDA)

    def run(case: tuple[Any, ...]) -> Row:
        shape, cfg = case
        return run_mixed(shape, page_size, copy_bw, config=cfg, max_requests=max_requests,
                         kv_dtype=kv_dtype)  # fmt: skip

    configs = [MixedConfig(rows_wide=rw, block_n=bn, block_n_narrow=bnn, num_warps=w, num_stages=st)
               for rw, bn, bnn, w, st in itertools.product((64, 128), (32, 64), (64, 128, 256),
                                                           (4, 8), (2, 3))]  # fmt: skip
    rows = search(itertools.product(MIXED_SHAPES[1:4:2], configs), run, "mixed_us",
                  lambda c: {"decode_rows": c[0][0], "prompt": c[0][2], **dataclasses.asdict(c[1])})  # fmt: skip
    rows.sort(key=lambda r: r["decode_rows"])  # stable: the fastest first within each step
    print_table("tune: mixed kernel tiles (num_splits 1)", rows, MIXED_COLUMNS)
    return rows
