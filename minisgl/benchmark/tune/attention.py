"""Tuners of the attention kernels on one CUDA GPU, on W3's cases (`minisgl.benchmark.kernels`,
whose timers and error checks they use): decode tiles and split counts (`DecodeConfig`,
`default_decode_config`), extend tiles (`ExtendConfig`), the mixed kernel's tiles
(`MixedConfig`). A tile that does not fit becomes an error row, not the end of the run."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import torch

from minisgl.benchmark.common import Row, print_table, time_graph
from minisgl.benchmark.kernels import (
    DECODE_COLUMNS,
    EXTEND_COLUMNS,
    MIXED_COLUMNS,
    MIXED_SHAPES,
    attempt,
    measure_copy_bandwidth,
    measure_matmul_rate,
    run_decode,
    run_extend,
    run_mixed,
)

# (batch, context, spread): W3's shapes, and W1's decode steps (ragged: contexts drawn from
# [1 - spread, 1 + spread] x the mean) of the 129-256 running requests and of the tail.
DECODE_SHAPES = ((256, 4096, 0.0), (256, 1024, 0.0), (32, 4096, 0.0), (1, 32768, 0.0),
                 (200, 820, 0.32), (80, 1250, 0.6), (48, 1400, 0.5))  # fmt: skip
SPLIT_SHAPES = ((1, 4096), (1, 32768), (32, 1024), (32, 4096), (256, 1024))


def _best(rows: list[Row], key: str, group: tuple[str, ...]) -> list[Row]:
    """The fastest row of each `group` value, rows with an error left out."""
    best: dict[tuple[object, ...], Row] = {}
    for r in rows:
        g = tuple(r.get(k) for k in group)
        if key in r and (g not in best or r[key] < best[g][key]):
            best[g] = r
    return list(best.values())


def tune_decode(page_size: int, kv_dtype: torch.dtype) -> list[Row]:
    """Keys per step x warps x pipeline stages at every DECODE_SHAPES shape (e4m3 pools: half
    the bytes, larger steps), then split counts at SPLIT_SHAPES with the default tiles."""
    from minisgl.kernels.attention.decode import DecodeConfig

    copy_bw = measure_copy_bandwidth(time_graph)
    fp8 = kv_dtype == torch.float8_e4m3fn
    dec = functools.partial(run_decode, kv_dtype=kv_dtype)
    rows = []
    for (b, ctx, spread), bn, w, st in itertools.product(
        DECODE_SHAPES, (64, 128, 256) if fp8 else (32, 64, 128), (4, 8), range(2, 6 if fp8 else 5)
    ):  # fmt: skip
        cfg = DecodeConfig(block_n=bn, block_n_unsplit=bn, num_warps=w, num_stages=st)
        label = {"batch": b, "context": ctx, "block_n": bn, "num_warps": w, "num_stages": st}
        rows.append(
            attempt(label, dec, b, ctx, page_size, time_graph, copy_bw, config=cfg, spread=spread)
        )
    for (b, ctx), splits in itertools.product(SPLIT_SHAPES, (1, 2, 4, 8, 16, 32, 64)):
        if splits * 128 <= ctx:
            label = {"batch": b, "context": ctx, "num_splits": splits}
            rows.append(
                attempt(label, dec, b, ctx, page_size, time_graph, copy_bw, num_splits=splits)
            )
    # A broken variant is off by O(1); e4m3 rounding stays far below 0.2.
    ok = [r for r in rows if r.get("rel_err", math.inf) < 0.2 or "error" in r]
    print_table("tune: decode", ok, DECODE_COLUMNS)
    print_table(
        "tune: decode, the fastest per shape",
        _best(ok, "time_us", ("batch", "context")),
        DECODE_COLUMNS,
    )
    return rows


def tune_extend(page_size: int, kv_dtype: torch.dtype) -> list[Row]:
    from minisgl.kernels.attention.extend import ExtendConfig

    rate = measure_matmul_rate(time_graph)
    ext = functools.partial(run_extend, kv_dtype=kv_dtype)
    rows = []
    for (r, n, c), bm, bn, w, st in itertools.product(
        ((1, 8192, 0), (16, 1024, 2048)), (64, 128), (32, 64, 128), (4, 8), (2, 3)
    ):
        cfg = ExtendConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
        label = {"requests": r, "new_tokens": n, "cached": c, **dataclasses.asdict(cfg)}
        rows.append(attempt(label, ext, r, n, c, page_size, time_graph, rate, config=cfg))
    print_table("tune: extend", rows, EXTEND_COLUMNS)
    print_table(
        "tune: extend, the fastest per shape", _best(rows, "time_us", ("requests",)), EXTEND_COLUMNS
    )
    return rows


def tune_mixed(page_size: int, kv_dtype: torch.dtype, max_requests: int) -> list[Row]:
    """The mixed kernel's tiles at two W4-like steps (num_splits 1)."""
    from minisgl.kernels.attention.mixed import MixedConfig

    copy_bw = measure_copy_bandwidth(time_graph)
    run = functools.partial(run_mixed, max_requests=max_requests, kv_dtype=kv_dtype)
    rows = []
    for shape, rw, bn, bnn, w, st in itertools.product(
        MIXED_SHAPES[1:4:2], (64, 128), (32, 64), (64, 128, 256), (4, 8), (2, 3)
    ):
        cfg = MixedConfig(rows_wide=rw, block_n=bn, block_n_narrow=bnn, num_warps=w, num_stages=st)
        label = {"decode_rows": shape[0], "prompt": shape[2], **dataclasses.asdict(cfg)}
        rows.append(attempt(label, run, shape, page_size, time_graph, copy_bw, config=cfg))
    rows.sort(key=lambda r: (r["decode_rows"], r.get("mixed_us", math.inf)))
    print_table("tune: mixed kernel tiles (num_splits 1)", rows, MIXED_COLUMNS)
    return rows
