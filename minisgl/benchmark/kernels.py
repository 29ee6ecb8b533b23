"""W3, the attention-kernel benchmark (BENCHMARKS.md): `python -m minisgl.benchmark.kernels`.

On one CUDA GPU, in one run: device-to-device copy bandwidth, the bf16 matmul rate, paged decode
attention (achieved bytes/s against the copy bandwidth) and paged extend attention (FLOP/s
against the matmul rate), each checked against the torch reference. Every figure is the median
over replays of a CUDA graph of back-to-back calls; small cases cycle through enough distinct
inputs that they do not sit in L2. Prints tables, then one JSON object as the last line.
`--tune` adds tile-size and split-count sweeps for choosing the kernels' defaults.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from minisgl.benchmark.common import time_graph
from minisgl.kernels.reference import decode_attention_ref, extend_attention_ref
from minisgl.kernels.testing import cu_seqlens, random_paged_kv

# W1's head layout (Qwen3-0.6B).
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128
DTYPE = torch.bfloat16
SM_SCALE = HEAD_DIM**-0.5
DECODE_BATCHES = (1, 32, 256)
DECODE_CONTEXTS = (512, 1024, 4096, 32768)
PAGE_SIZES = (1, 16, 32, 64)
PAGE_SWEEP_SHAPE = (256, 4096)  # (batch, context) of the page-size sweep
EXTEND_SHAPES = ((1, 8192), (16, 1024))  # (requests, new tokens of each)
EXTEND_CACHED = (0, 2048)
REF_REQUESTS = 4  # requests of each case checked against the torch reference
MAX_INPUT_SETS = 64

DEVICE = "cuda"

Row = dict[str, Any]
# timer(fn, n_sets) -> seconds per call of fn(i), i cycling over range(n_sets)
Timer = Callable[[Callable[[int], object], int], float]


def _l2_bytes() -> int:
    return torch.cuda.get_device_properties(DEVICE).L2_cache_size


def measure_copy_bandwidth(timer: Timer, nbytes: int = 2 << 30) -> float:
    """Bytes/s of a large device-to-device copy (SM-driven; see `bandwidth.py`)."""
    from minisgl.benchmark.bandwidth import measure_copy_bandwidth as measure

    return measure(nbytes)


def measure_matmul_rate(timer: Timer, n: int = 8192) -> float:
    """FLOP/s of an n x n x n bf16 matmul."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=DEVICE)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=DEVICE)
    c = torch.empty_like(a)
    seconds = timer(lambda _: torch.matmul(a, b, out=c), 1)
    return 2 * n**3 / seconds


def _errors(out: torch.Tensor, expected: torch.Tensor) -> Row:
    max_abs = (out.float() - expected).abs().max().item()
    return {"max_abs_err": max_abs, "rel_err": max_abs / expected.abs().max().item()}


def run_decode(
    batch: int,
    context: int,
    page_size: int,
    timer: Timer,
    copy_bw: float,
    *,
    num_splits: int | None = None,
    config: Any = None,
    spread: float = 0.0,
) -> Row:
    """Decode attention with every request at `context` tokens on randomly scattered pages;
    with `spread` s, contexts drawn uniformly from [context * (1 - s), context * (1 + s)]
    (ragged, like a continuous batch)."""
    from minisgl.kernels.common import num_sms
    from minisgl.kernels.decode import choose_num_splits, decode_attention, default_decode_config

    elem = torch.empty((), dtype=DTYPE).element_size()
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * elem
    qo_bytes = 2 * batch * NUM_Q_HEADS * HEAD_DIM * elem
    n_sets = max(1, min(MAX_INPUT_SETS, math.ceil(4 * _l2_bytes() / kv_bytes)))
    lo, hi = round(context * (1 - spread)), round(context * (1 + spread))
    gen = torch.Generator().manual_seed(batch * 7 + context)
    contexts = torch.randint(lo, hi + 1, (n_sets, batch), generator=gen)
    contexts[:, 0] = hi  # the largest context of every set is the same: the splits' host bound
    kv_bytes = 2 * int(contexts[0].sum()) * NUM_KV_HEADS * HEAD_DIM * elem
    kv = random_paged_kv(
        contexts.flatten().tolist(), page_size, NUM_KV_HEADS, HEAD_DIM, DTYPE, DEVICE, poison=False
    )
    tables = kv.block_table.view(n_sets, batch, -1)
    lens = kv.seq_lens.view(n_sets, batch)
    q = torch.randn(n_sets, batch, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    out = torch.empty_like(q)
    cfg = config or default_decode_config(HEAD_DIM)
    splits = num_splits or choose_num_splits(batch, NUM_KV_HEADS, hi, num_sms(q.device), cfg)

    def call(i: int) -> None:
        decode_attention(
            q[i],
            kv.k_cache,
            kv.v_cache,
            tables[i],
            lens[i],
            page_size,
            SM_SCALE,
            num_splits=splits,
            config=cfg,
            out=out[i],
        )

    seconds = timer(call, n_sets)
    call(0)
    rows = min(batch, REF_REQUESTS)
    expected = decode_attention_ref(
        q[0, :rows], kv.k_cache, kv.v_cache, tables[0, :rows], lens[0, :rows], page_size, SM_SCALE
    )
    bytes_per_s = (kv_bytes + qo_bytes) / seconds
    return {
        "batch": batch,
        "context": context,
        "spread": spread,
        "page_size": page_size,
        "num_splits": splits,
        "block_n": cfg.block_n if splits > 1 else cfg.block_n_unsplit,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
        "time_us": seconds * 1e6,
        "bytes_per_s": bytes_per_s,
        "fraction_of_copy": bytes_per_s / copy_bw,
        **_errors(out[0, :rows], expected),
    }


def run_extend(
    num_reqs: int,
    new_tokens: int,
    cached: int,
    page_size: int,
    timer: Timer,
    matmul_rate: float,
    *,
    config: Any = None,
) -> Row:
    """Extend attention: `num_reqs` requests of `new_tokens` each on `cached` cached tokens."""
    from minisgl.kernels.extend import default_extend_config, extend_attention

    seq_lens = [cached + new_tokens] * num_reqs
    kv = random_paged_kv(seq_lens, page_size, NUM_KV_HEADS, HEAD_DIM, DTYPE, DEVICE, poison=False)
    ext = torch.full((num_reqs,), new_tokens, dtype=torch.int32, device=DEVICE)
    cu = cu_seqlens([new_tokens] * num_reqs, DEVICE)
    q = torch.randn(num_reqs * new_tokens, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    out = torch.empty_like(q)
    cfg = config or default_extend_config(HEAD_DIM)
    args = (kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, ext, cu, page_size, SM_SCALE)
    seconds = timer(lambda _: extend_attention(q, *args, new_tokens, config=cfg, out=out), 1)
    # Query at position p sees p + 1 keys: QK^T and PV are 2 * D FLOPs per (query, key, head) each.
    visible = num_reqs * (new_tokens * cached + new_tokens * (new_tokens + 1) // 2)
    flops = 4 * NUM_Q_HEADS * HEAD_DIM * visible
    n = min(num_reqs, 2)
    rows = n * new_tokens
    expected = extend_attention_ref(
        q[:rows],
        kv.k_cache,
        kv.v_cache,
        kv.block_table[:n],
        kv.seq_lens[:n],
        ext[:n],
        cu[: n + 1],
        page_size,
        SM_SCALE,
    )
    return {
        "requests": num_reqs,
        "new_tokens": new_tokens,
        "cached": cached,
        "page_size": page_size,
        "block_m": cfg.block_m,
        "block_n": cfg.block_n,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
        "time_us": seconds * 1e6,
        "flop_per_s": flops / seconds,
        "fraction_of_matmul": flops / seconds / matmul_rate,
        **_errors(out[:rows], expected),
    }


def _attempt(label: Row, fn: Callable[..., Row], *args: Any, **kwargs: Any) -> Row:
    """Run one case; one that fails (a tile that does not fit, out of memory) becomes an error
    row labelled `label` instead of ending the run."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # triton and torch raise several unrelated types here
        return {**label, "error": f"{type(e).__name__}: {str(e)[:120]}"}
    finally:
        torch.cuda.empty_cache()


def tune_decode(timer: Timer, copy_bw: float, page_size: int) -> list[Row]:
    from minisgl.kernels.decode import DecodeConfig

    rows = []
    shapes = [(256, 4096), (32, 4096), (1, 32768)]
    for (b, ctx), bn, w, st in itertools.product(shapes, (32, 64, 128), (4, 8), (2, 3, 4)):
        cfg = DecodeConfig(block_n=bn, block_n_unsplit=bn, num_warps=w, num_stages=st)
        label = {"batch": b, "context": ctx, "block_n": bn, "num_warps": w, "num_stages": st}
        rows.append(_attempt(label, run_decode, b, ctx, page_size, timer, copy_bw, config=cfg))
    shapes = [(1, 4096), (1, 32768), (32, 1024), (32, 4096), (256, 1024)]
    for (b, ctx), splits in itertools.product(shapes, (1, 2, 4, 8, 16, 32, 64)):
        if splits * 128 <= ctx:
            label = {"batch": b, "context": ctx, "num_splits": splits}
            rows.append(
                _attempt(label, run_decode, b, ctx, page_size, timer, copy_bw, num_splits=splits)
            )
    return rows


# W1's decode steps: (batch, mean context, spread) of the 129-256 steps (late prompts done, contexts
# 560-1080) and of the 33-128 tail (the long-output requests, contexts ~500-2000).
W1_DECODE_SHAPES = [(200, 820, 0.32), (80, 1250, 0.6), (48, 1400, 0.5)]


def tune_w1_decode(timer: Timer, copy_bw: float, page_size: int) -> list[Row]:
    """Decode tiles and split counts on W1-like ragged batches (None: the default split)."""
    from minisgl.kernels.decode import DecodeConfig

    rows = []
    for (b, c, spread), splits, bn, st in itertools.product(
        W1_DECODE_SHAPES, (None, 1, 2, 3, 4, 6), (64, 128), (2, 3)
    ):
        cfg = DecodeConfig(block_n=bn, block_n_unsplit=bn, num_stages=st)
        label = {"batch": b, "context": c, "num_splits": splits, "block_n": bn, "num_stages": st}
        rows.append(
            _attempt(label, run_decode, b, c, page_size, timer, copy_bw, num_splits=splits,
                     config=cfg, spread=spread)
        )  # fmt: skip
    return rows


def tune_extend(timer: Timer, matmul_rate: float, page_size: int) -> list[Row]:
    from minisgl.kernels.extend import ExtendConfig

    rows = []
    shapes = [(1, 8192, 0), (16, 1024, 2048)]
    for (r, n, c), bm, bn, w, st in itertools.product(
        shapes, (64, 128), (32, 64, 128), (4, 8), (2, 3)
    ):
        cfg = ExtendConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
        label = {"requests": r, "new_tokens": n, "cached": c, "block_m": bm, "block_n": bn,
                 "num_warps": w, "num_stages": st}  # fmt: skip
        rows.append(_attempt(label, run_extend, r, n, c, page_size, timer, matmul_rate, config=cfg))
    return rows


def print_table(title: str, rows: Sequence[Row], columns: Sequence[str]) -> None:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.3e}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] + [r.get("error", "")] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print(f"\n{title}")
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row[:-1], widths, strict=True)), row[-1])


# fmt: off
DECODE_COLUMNS = ["batch", "context", "page_size", "num_splits", "block_n", "num_warps",
                  "num_stages", "time_us", "bytes_per_s", "fraction_of_copy", "rel_err"]
EXTEND_COLUMNS = ["requests", "new_tokens", "cached", "block_m", "block_n", "num_warps",
                  "num_stages", "time_us", "flop_per_s", "fraction_of_matmul", "rel_err"]
# fmt: on


def run_all(args: argparse.Namespace, timer: Timer) -> Row:
    copy_bw = measure_copy_bandwidth(timer)
    ps = args.page_size
    if args.w1:  # only the W1-shape sweep
        rows = sorted(
            tune_w1_decode(timer, copy_bw, ps),
            key=lambda r: (r["batch"], r.get("time_us", math.inf)),
        )
        print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s")
        print_table("W1-like ragged decode batches", rows, DECODE_COLUMNS)
        return {"copy_bytes_per_s": copy_bw, "tune_w1_decode": rows}
    matmul_rate = measure_matmul_rate(timer)
    print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s, bf16 matmul {matmul_rate / 1e12:.1f} TFLOP/s")
    decode = [
        _attempt({"batch": b, "context": c}, run_decode, b, c, ps, timer, copy_bw)
        for b, c in itertools.product(DECODE_BATCHES, DECODE_CONTEXTS)
    ]
    print_table(f"decode attention (page_size {ps})", decode, DECODE_COLUMNS)
    b, c = PAGE_SWEEP_SHAPE
    sweep = [_attempt({"page_size": p}, run_decode, b, c, p, timer, copy_bw) for p in PAGE_SIZES]
    print_table(f"decode page-size sweep (batch {b} x {c})", sweep, DECODE_COLUMNS)
    extend = [
        _attempt({"requests": r, "cached": c}, run_extend, r, n, c, ps, timer, matmul_rate)
        for (r, n), c in itertools.product(EXTEND_SHAPES, EXTEND_CACHED)
    ]
    print_table(f"extend attention (page_size {ps})", extend, EXTEND_COLUMNS)
    result: Row = {
        "copy_bytes_per_s": copy_bw,
        "matmul_flop_per_s": matmul_rate,
        "decode": decode,
        "decode_page_size_sweep": sweep,
        "extend": extend,
    }
    if args.tune:
        result["tune_decode"] = tune_decode(timer, copy_bw, ps)
        print_table("tune: decode", result["tune_decode"], DECODE_COLUMNS)
        result["tune_extend"] = tune_extend(timer, matmul_rate, ps)
        print_table("tune: extend", result["tune_extend"], EXTEND_COLUMNS)
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-size", type=int, default=16, help="page size of the main tables")
    parser.add_argument("--tune", action="store_true", help="also sweep tiles and split counts")
    parser.add_argument(
        "--w1",
        action="store_true",
        help="only sweep decode tiles and splits on W1-like ragged batches",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("minisgl.benchmark.kernels needs a CUDA GPU; none is visible here.")
    try:
        import triton
    except ImportError:
        raise SystemExit("the Triton kernels need triton: pip install 'minisgl[gpu]'") from None
    torch.manual_seed(0)
    header = {
        "workload": "W3",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": "bfloat16",
        "num_q_heads": NUM_Q_HEADS,
        "num_kv_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
    }
    print(
        f"W3 attention kernels on {header['device']} (torch {torch.__version__}, "
        f"triton {triton.__version__})"
    )
    result = run_all(args, time_graph)
    print(json.dumps({**header, **result}))


if __name__ == "__main__":
    main()
