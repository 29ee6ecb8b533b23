"""W3, the attention-kernel benchmark (BENCHMARKS.md): `python -m minisgl.benchmark.kernels`.

On one CUDA GPU, in one run: device-to-device copy bandwidth, the bf16 matmul rate, paged decode
attention (achieved bytes/s against the copy bandwidth) and paged extend attention (FLOP/s
against the matmul rate), each checked against the torch reference. Every figure is the median
over replays of a CUDA graph of back-to-back calls; small cases cycle through enough distinct
inputs that they do not sit in L2. Prints tables, then one JSON object as the last line.
`--tune` adds tile-size and split-count sweeps for choosing the kernels' defaults (with
`--decode-only`, only the decode sweep). `--kv-cache-dtype fp8_e4m3` runs the attention on an e4m3
pool (bytes counted at one per value, plus the per-head scales); with `--tune` its decode sweep
(`tune_decode_fp8`, a few minutes) prints the config to paste into `default_decode_config`.
`--fp8-gemm` runs only the sweep that sets `FP8_GEMV_MAX_ROWS` (minisgl/config/quant.py): the
FP8 weight-only GEMV against the FP8 tensor-core GEMM (per-token activation quantization
included) and bf16 `F.linear`, at Llama-3-8B projection shapes, rows 1..256.
`--mixed` runs only mixed steps (issue 23: decode rows beside one prompt, W4-like): the one-launch
`mixed_attention` at the step's token bucket against today's decode-split + extend pair, device
us of each (CUDA graph), their fraction of the copy bandwidth (every context's K/V read once)
and host us of an eager call; with `--tune`, the mixed kernel's tile sweep (128 configs x 2
shapes, several minutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from minisgl.benchmark.common import time_graph
from minisgl.kernels.attention.reference import decode_attention_ref, extend_attention_ref
from minisgl.kernels.attention.testing import cu_seqlens, random_paged_kv

# W1's head layout (Qwen3-0.6B).
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128


class Heads(NamedTuple):
    """A decode table's attention geometry (`--decode-heads`): W3's by default."""

    q: int = NUM_Q_HEADS
    kv: int = NUM_KV_HEADS
    dim: int = HEAD_DIM


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
KV_DTYPES = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}

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


class DecodeCase(NamedTuple):
    """Inputs of one decode shape: `n_sets` batches over one pool (cycled so L2 does not hold
    them) and the bytes one call must move."""

    kv: Any  # PagedKV
    tables: torch.Tensor  # [n_sets, batch, P] int32
    lens: torch.Tensor  # [n_sets, batch] int32
    q: torch.Tensor  # [n_sets, batch, Hq, D]
    max_len: int  # the largest context of every set: the splits' host bound
    nbytes: int  # K/V of set 0 at one element size each, their scales, q and the output


@functools.lru_cache(maxsize=1)  # a sweep times many configs on one shape: build it once
def decode_case(
    batch: int,
    context: int,
    page_size: int,
    spread: float,
    kv_dtype: torch.dtype,
    heads: Heads = Heads(),
) -> DecodeCase:
    """Every request at `context` tokens on randomly scattered pages; with `spread` s, contexts
    drawn uniformly from [context * (1 - s), context * (1 + s)] (ragged, like a continuous
    batch)."""
    elem = torch.empty((), dtype=kv_dtype).element_size()  # 1 for e4m3
    kv_bytes = 2 * batch * context * heads.kv * heads.dim * elem
    n_sets = max(1, min(MAX_INPUT_SETS, math.ceil(4 * _l2_bytes() / kv_bytes)))
    lo, hi = round(context * (1 - spread)), round(context * (1 + spread))
    gen = torch.Generator().manual_seed(batch * 7 + context)
    contexts = torch.randint(lo, hi + 1, (n_sets, batch), generator=gen)
    contexts[:, 0] = hi
    kv = random_paged_kv(
        contexts.flatten().tolist(), page_size, heads.kv, heads.dim, kv_dtype, DEVICE,
        poison=False,
    )  # fmt: skip
    kv_bytes = 2 * int(contexts[0].sum()) * heads.kv * heads.dim * elem
    scale_bytes = 2 * heads.kv * 4 if kv.kv_scales is not None else 0  # fp32 per KV head
    qo_bytes = 2 * batch * heads.q * heads.dim * torch.empty((), dtype=DTYPE).element_size()
    q = torch.randn(n_sets, batch, heads.q, heads.dim, dtype=DTYPE, device=DEVICE)
    tables, lens = kv.block_table.view(n_sets, batch, -1), kv.seq_lens.view(n_sets, batch)
    return DecodeCase(kv, tables, lens, q, hi, kv_bytes + scale_bytes + qo_bytes)


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
    kv_dtype: torch.dtype = DTYPE,
    heads: Heads = Heads(),
) -> Row:
    """Decode attention over `decode_case(...)`: achieved bytes/s against the copy bandwidth."""
    from minisgl.kernels.attention.decode import (
        choose_num_splits,
        decode_attention,
        default_decode_config,
    )
    from minisgl.kernels.common import num_sms

    case = decode_case(batch, context, page_size, spread, kv_dtype, heads)
    kv, tables, lens, q = case.kv, case.tables, case.lens, case.q
    out = torch.empty_like(q)
    cfg = config or default_decode_config(heads.dim, kv_dtype == torch.float8_e4m3fn)
    splits = num_splits or choose_num_splits(batch, heads.kv, case.max_len, num_sms(q.device), cfg)
    sm_scale = heads.dim**-0.5

    def call(i: int) -> None:
        decode_attention(
            q[i],
            kv.k_cache,
            kv.v_cache,
            tables[i],
            lens[i],
            page_size,
            sm_scale,
            num_splits=splits,
            config=cfg,
            out=out[i],
            kv_scales=kv.kv_scales,
        )

    seconds = timer(call, q.shape[0])
    call(0)
    rows = min(batch, REF_REQUESTS)
    expected = decode_attention_ref(
        q[0, :rows], kv.k_cache, kv.v_cache, tables[0, :rows], lens[0, :rows], page_size,
        sm_scale, kv.kv_scales,
    )  # fmt: skip
    bytes_per_s = case.nbytes / seconds
    return {
        "batch": batch,
        "context": context,
        "kv_dtype": str(kv_dtype).removeprefix("torch."),
        "heads": ",".join(map(str, heads)),
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
    kv_dtype: torch.dtype = DTYPE,
) -> Row:
    """Extend attention: `num_reqs` requests of `new_tokens` each on `cached` cached tokens."""
    from minisgl.kernels.attention.extend import default_extend_config, extend_attention

    seq_lens = [cached + new_tokens] * num_reqs
    kv = random_paged_kv(
        seq_lens, page_size, NUM_KV_HEADS, HEAD_DIM, kv_dtype, DEVICE, poison=False
    )
    ext = torch.full((num_reqs,), new_tokens, dtype=torch.int32, device=DEVICE)
    cu = cu_seqlens([new_tokens] * num_reqs, DEVICE)
    q = torch.randn(num_reqs * new_tokens, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    out = torch.empty_like(q)
    cfg = config or default_extend_config(HEAD_DIM)
    args = (kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, ext, cu, page_size, SM_SCALE)
    scales = kv.kv_scales
    seconds = timer(
        lambda _: extend_attention(q, *args, new_tokens, config=cfg, out=out, kv_scales=scales), 1
    )
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
        kv.kv_scales,
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


# ---- mixed steps (issue 23): the one-launch kernel against today's decode-split + extend ---------

# (decode rows, their mean context, prompt tokens): W4-like mixed steps at 16 req/s, contexts
# drawn from [0.5, 1.5] x the mean; the prompt has no cached prefix.
MIXED_SHAPES = ((20, 1000, 100), (20, 1000, 1000), (32, 1000, 500), (64, 1000, 100),
                (64, 1000, 1000), (8, 4000, 200))  # fmt: skip
MIXED_SPLITS = (1, 2, 4)
MIXED_MAX_REQUESTS = 256  # the request capacity captured with each token bucket


class MixedCase(NamedTuple):
    kv: Any  # PagedKV of Bmax requests: the step's decodes, its prompt, spare requests
    q: torch.Tensor  # [Tp, Hq, D]
    cu: torch.Tensor  # [Bmax+1] int32
    num_decode: int
    prompt: int
    nbytes: int  # K/V of every context once, q and output of the real rows


def mixed_case(
    num_decode: int, context: int, prompt: int, page_size: int, max_requests: int,
    kv_dtype: torch.dtype,
) -> MixedCase:  # fmt: skip
    from minisgl.engine.piecewise import token_buckets

    gen = torch.Generator().manual_seed(num_decode * 7 + prompt)
    lens = torch.randint(context // 2, context * 3 // 2 + 1, (num_decode,), generator=gen)
    spare = max_requests - num_decode - 1
    seq = [*lens.tolist(), prompt] + [1] * spare
    kv = random_paged_kv(seq, page_size, NUM_KV_HEADS, HEAD_DIM, kv_dtype, DEVICE, poison=False)
    t = num_decode + prompt
    tp = min(b for b in token_buckets(max(2048, t)) if b >= t)
    q = torch.randn(tp, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    cu = cu_seqlens([1] * num_decode + [prompt] + [0] * spare, DEVICE)
    elem = torch.empty((), dtype=kv_dtype).element_size()
    kv_bytes = 2 * (int(lens.sum()) + prompt) * NUM_KV_HEADS * HEAD_DIM * elem
    qo_bytes = 2 * t * NUM_Q_HEADS * HEAD_DIM * torch.empty((), dtype=DTYPE).element_size()
    return MixedCase(kv, q, cu, num_decode, prompt, kv_bytes + qo_bytes)


def run_mixed(
    shape: tuple[int, int, int],
    page_size: int,
    timer: Timer,
    copy_bw: float,
    *,
    num_splits: int = 1,
    config: Any = None,
    max_requests: int = MIXED_MAX_REQUESTS,
    kv_dtype: torch.dtype = DTYPE,
) -> Row:
    """One mixed step's attention (one layer): `mixed_attention` at the step's token bucket
    against today's pair (`decode_attention` on the decode rows, `extend_attention` on the
    prompt, as `TritonBackend` launches them), device time in a CUDA graph and host time of an
    eager call each, and the mixed kernel's error against the torch reference."""
    from minisgl.kernels.attention.decode import (
        choose_num_splits,
        decode_attention,
        default_decode_config,
    )
    from minisgl.kernels.attention.extend import default_extend_config, extend_attention
    from minisgl.kernels.attention.mixed import default_mixed_config, mixed_attention
    from minisgl.kernels.common import num_sms

    nd, ctx, prompt = shape
    case = mixed_case(nd, ctx, prompt, page_size, max_requests, kv_dtype)
    kv, q, cu = case.kv, case.q, case.cu
    t = nd + prompt
    cfg = config or default_mixed_config(HEAD_DIM)
    out = torch.empty_like(q)
    caches = (kv.k_cache, kv.v_cache)

    def mixed(_: int) -> None:
        mixed_attention(q, *caches, kv.block_table, kv.seq_lens, cu, page_size, SM_SCALE,
                        num_splits=num_splits, config=cfg, out=out, kv_scales=kv.kv_scales)  # fmt: skip

    dcfg = default_decode_config(HEAD_DIM, kv_dtype == torch.float8_e4m3fn)
    dsplits = choose_num_splits(nd, NUM_KV_HEADS, max(kv.seq_lens_host[:nd]), num_sms(q.device),
                                dcfg)  # fmt: skip
    d_table, d_lens = kv.block_table[:nd], kv.seq_lens[:nd]
    e_table, e_lens = kv.block_table[nd : nd + 1].clone(), kv.seq_lens[nd : nd + 1].clone()
    e_ext = torch.tensor([prompt], dtype=torch.int32, device=DEVICE)
    e_cu = cu_seqlens([prompt], DEVICE)
    pair_out = torch.empty_like(q)

    def pair(_: int) -> None:
        decode_attention(q[:nd], *caches, d_table, d_lens, page_size, SM_SCALE,
                         num_splits=dsplits, config=dcfg, out=pair_out[:nd],
                         kv_scales=kv.kv_scales)  # fmt: skip
        extend_attention(q[nd:t], *caches, e_table, e_lens, e_ext, e_cu, page_size, SM_SCALE,
                         prompt, config=default_extend_config(HEAD_DIM), out=pair_out[nd:t],
                         kv_scales=kv.kv_scales)  # fmt: skip

    mixed_s, pair_s = timer(mixed, 1), timer(pair, 1)
    mixed(0)
    b = nd + 1
    ext = cu[1 : b + 1] - cu[:b]
    expected = extend_attention_ref(q[:t], *caches, kv.block_table[:b], kv.seq_lens[:b], ext,
                                    cu[: b + 1], page_size, SM_SCALE, kv.kv_scales)  # fmt: skip
    padding_zero = bool((out[t:] == 0).all())
    return {
        "decode_rows": nd, "context": ctx, "prompt": prompt, "tokens": t, "bucket": q.shape[0],
        "max_requests": max_requests, "num_splits": num_splits, "rows_wide": cfg.rows_wide,
        "block_n": cfg.block_n, "block_n_narrow": cfg.block_n_narrow,
        "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
        "mixed_us": mixed_s * 1e6, "pair_us": pair_s * 1e6, "pair_decode_splits": dsplits,
        "mixed_fraction_of_copy": case.nbytes / mixed_s / copy_bw,
        "pair_fraction_of_copy": case.nbytes / pair_s / copy_bw,
        "mixed_host_us": _eager_host_us(mixed), "pair_host_us": _eager_host_us(pair),
        "padding_zero": padding_zero, **_errors(out[:t], expected),
    }  # fmt: skip


def _eager_host_us(fn: Callable[[int], object], calls: int = 50) -> float:
    """Host us per eager call (the launch path a step pays outside a CUDA graph)."""
    import time

    fn(0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(calls):
        fn(i)
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / calls * 1e6


def run_mixed_all(args: argparse.Namespace, timer: Timer, copy_bw: float) -> Row:
    from minisgl.kernels.attention.mixed import MixedConfig, default_mixed_config

    kv_dtype = KV_DTYPES[args.kv_cache_dtype]
    ps = args.page_size
    run = functools.partial(run_mixed, max_requests=args.mixed_max_requests, kv_dtype=kv_dtype)
    rows = []
    cfg = default_mixed_config(HEAD_DIM)
    for shape, splits in itertools.product(MIXED_SHAPES, MIXED_SPLITS):
        label = {"decode_rows": shape[0], "context": shape[1], "prompt": shape[2],
                 "num_splits": splits}  # fmt: skip
        rows.append(_attempt(label, run, shape, ps, timer, copy_bw, num_splits=splits,
                             config=cfg))  # fmt: skip
    print_table(f"mixed steps: one launch vs decode-split + extend (page_size {ps}, "
                f"{args.kv_cache_dtype} KV; us of one layer)", rows, MIXED_COLUMNS)  # fmt: skip
    result: Row = {"mixed": rows}
    if args.tune:
        tune = []
        for shape, rw, bn, bnn, w, st in itertools.product(
            MIXED_SHAPES[1:4:2], (64, 128), (32, 64), (64, 128, 256), (4, 8), (2, 3)
        ):
            cfg = MixedConfig(rows_wide=rw, block_n=bn, block_n_narrow=bnn, num_warps=w,
                              num_stages=st)  # fmt: skip
            label = {"decode_rows": shape[0], "prompt": shape[2], **dataclasses.asdict(cfg)}
            tune.append(_attempt(label, run, shape, ps, timer, copy_bw, config=cfg))
        tune.sort(key=lambda r: (r["decode_rows"], r.get("mixed_us", math.inf)))
        print_table("tune: mixed kernel tiles (num_splits 1)", tune, MIXED_COLUMNS)
        result["tune_mixed"] = tune
    return result


def _attempt(label: Row, fn: Callable[..., Row], *args: Any, **kwargs: Any) -> Row:
    """Run one case; one that fails (a tile that does not fit, out of memory) becomes an error
    row labelled `label` instead of ending the run."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # triton and torch raise several unrelated types here
        return {**label, "error": f"{type(e).__name__}: {str(e)[:120]}"}
    finally:
        torch.cuda.empty_cache()


def tune_decode(
    timer: Timer, copy_bw: float, page_size: int, kv_dtype: torch.dtype = DTYPE
) -> list[Row]:
    from minisgl.kernels.attention.decode import DecodeConfig

    dec = functools.partial(run_decode, kv_dtype=kv_dtype)
    blocks = (32, 64, 128) if kv_dtype == DTYPE else (64, 128, 256)  # FP8: half the bytes
    rows = []
    shapes = [(256, 4096), (32, 4096), (1, 32768)]
    for (b, ctx), bn, w, st in itertools.product(shapes, blocks, (4, 8), (2, 3, 4)):
        cfg = DecodeConfig(block_n=bn, block_n_unsplit=bn, num_warps=w, num_stages=st)
        label = {"batch": b, "context": ctx, "block_n": bn, "num_warps": w, "num_stages": st}
        rows.append(_attempt(label, dec, b, ctx, page_size, timer, copy_bw, config=cfg))
    shapes = [(1, 4096), (1, 32768), (32, 1024), (32, 4096), (256, 1024)]
    for (b, ctx), splits in itertools.product(shapes, (1, 2, 4, 8, 16, 32, 64)):
        if splits * 128 <= ctx:
            label = {"batch": b, "context": ctx, "num_splits": splits}
            rows.append(_attempt(label, dec, b, ctx, page_size, timer, copy_bw, num_splits=splits))
    return rows


# FP8 (e4m3) decode sweep: every config of the grid at W3's shape, then the best few at the other
# shapes (W3's target is batch 256 at contexts >= 1024).
# (batch, context, spread); the last is W1's main decode step (a ragged batch, see below).
FP8_TUNE_SHAPE = (256, 4096, 0.0)
FP8_CHECK_SHAPES = ((256, 1024, 0.0), (32, 4096, 0.0), (1, 4096, 0.0), (1, 32768, 0.0),
                    (200, 820, 0.32))  # fmt: skip
FP8_FINALISTS = 6
# Split heuristic knobs tried with the best config where requests are split (batch 1 and 32).
FP8_SPLIT_KNOBS = tuple(itertools.product((2, 4, 8), (64, 128, 256)))


def fp8_decode_grid() -> list[Any]:
    """Keys per step, warps and pipeline depth (how many blocks of page ids and K/V are loaded
    ahead), the default first. What the session-13 sweep on the H200 showed cannot win is left
    out: register caps, P V as (V^T P^T)^T, e4m3 scores, 2 stages."""
    from minisgl.kernels.attention.decode import DecodeConfig, default_decode_config

    grid = [default_decode_config(HEAD_DIM, kv_fp8=True)]
    for bn, w, st in itertools.product((64, 128, 256), (4, 8), (3, 4, 5)):
        grid.append(DecodeConfig(bn, bn, w, st))
    return list(dict.fromkeys(grid))


def tune_decode_fp8(timer: Timer, copy_bw: float, page_size: int) -> list[Row]:
    """The grid at FP8_TUNE_SHAPE, then the default and the fastest FP8_FINALISTS at
    FP8_CHECK_SHAPES, then the split heuristic's knobs; prints the config to paste into
    `default_decode_config`."""
    grid = fp8_decode_grid()
    rows = [_decode_attempt(FP8_TUNE_SHAPE, page_size, timer, copy_bw, cfg) for cfg in grid]
    # A broken variant is off by O(1); e4m3 rounding stays far below 0.2.
    timed = [grid[i] for _, i in sorted(
        (r["time_us"], i) for i, r in enumerate(rows) if "time_us" in r and r["rel_err"] < 0.2
    )]  # fmt: skip
    finalists = list(dict.fromkeys([grid[0], *timed[:FP8_FINALISTS]]))
    for shape, cfg in itertools.product(FP8_CHECK_SHAPES, finalists):
        rows.append(_decode_attempt(shape, page_size, timer, copy_bw, cfg))
    print_table("tune: FP8 decode (fraction_of_copy counts one byte per K/V value)", rows,
                DECODE_COLUMNS)  # fmt: skip
    best = _print_best_fp8(rows, finalists)
    split_rows = []
    for shape, (per_sm, min_tokens) in itertools.product(FP8_CHECK_SHAPES, FP8_SPLIT_KNOBS):
        if shape[0] <= 32:
            cfg = dataclasses.replace(best, programs_per_sm=per_sm, min_split_tokens=min_tokens)
            split_rows.append(_decode_attempt(shape, page_size, timer, copy_bw, cfg))
    print_table("tune: FP8 decode split heuristic (best config)", split_rows,
                DECODE_COLUMNS + ["programs_per_sm", "min_split_tokens"])  # fmt: skip
    for shape in FP8_CHECK_SHAPES:
        done = [r for r in split_rows if _shape(r) == shape and "time_us" in r]
        if done:
            r = min(done, key=lambda r: r["time_us"])
            print(f"  best split knobs at {shape}: programs_per_sm={r['programs_per_sm']}, "
                  f"min_split_tokens={r['min_split_tokens']} ({r['num_splits']} splits, "
                  f"{r['fraction_of_copy']:.3f})")  # fmt: skip
    return [{**r, "config": dataclasses.asdict(r["config"])} for r in rows + split_rows]


def _shape(row: Row) -> tuple[int, int, float]:
    return row["batch"], row["context"], row.get("spread", 0.0)


def _decode_attempt(
    shape: tuple[int, int, float], page_size: int, timer: Timer, copy_bw: float, cfg: Any
) -> Row:
    b, ctx, spread = shape
    label = {"batch": b, "context": ctx, "spread": spread, **_config_label(cfg)}
    row = _attempt(label, run_decode, b, ctx, page_size, timer, copy_bw, config=cfg,
                   spread=spread, kv_dtype=torch.float8_e4m3fn)  # fmt: skip
    return {**row, **label, "config": cfg}


def _config_label(cfg: Any) -> Row:
    return {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
            "programs_per_sm": cfg.programs_per_sm, "min_split_tokens": cfg.min_split_tokens}  # fmt: skip


def _print_best_fp8(rows: Sequence[Row], finalists: Sequence[Any]) -> Any:
    """Prints each finalist's fraction per shape; returns (and prints) the one with the best
    worst case at batch 256 (W3's target)."""
    shapes = (FP8_TUNE_SHAPE, *FP8_CHECK_SHAPES)
    target = [s for s in shapes if s[0] == FP8_TUNE_SHAPE[0]]

    def fraction(cfg: Any, shape: tuple[int, int, float]) -> float:
        found = [r.get("fraction_of_copy", 0.0) for r in rows
                 if r["config"] == cfg and _shape(r) == shape]  # fmt: skip
        return max(found, default=0.0)

    def worst(cfg: Any) -> float:
        return min(fraction(cfg, s) for s in target)

    print("\nFP8 decode, fraction of the copy bandwidth per (batch, context, spread):")
    for cfg in finalists:
        print(f"  {cfg}:\n    " + "  ".join(f"{s} {fraction(cfg, s):.3f}" for s in shapes))
    best = max(finalists, key=worst)
    print(f"\nbest at batch {target[0][0]} (worst fraction {worst(best):.3f}); paste into "
          f"default_decode_config's kv_fp8 branch:\n  {best!r}")  # fmt: skip
    return best


# W1's decode steps: (batch, mean context, spread) of the 129-256 steps (late prompts done, contexts
# 560-1080) and of the 33-128 tail (the long-output requests, contexts ~500-2000).
W1_DECODE_SHAPES = [(200, 820, 0.32), (80, 1250, 0.6), (48, 1400, 0.5)]


def tune_w1_decode(
    timer: Timer, copy_bw: float, page_size: int, kv_dtype: torch.dtype = DTYPE
) -> list[Row]:
    """Decode tiles and split counts on W1-like ragged batches (None: the default split)."""
    from minisgl.kernels.attention.decode import DecodeConfig

    dec = functools.partial(run_decode, kv_dtype=kv_dtype)
    rows = []
    for (b, c, spread), splits, bn, st in itertools.product(
        W1_DECODE_SHAPES, (None, 1, 2, 3, 4, 6), (64, 128), (2, 3)
    ):
        cfg = DecodeConfig(block_n=bn, block_n_unsplit=bn, num_stages=st)
        label = {"batch": b, "context": c, "num_splits": splits, "block_n": bn, "num_stages": st}
        rows.append(
            _attempt(label, dec, b, c, page_size, timer, copy_bw, num_splits=splits,
                     config=cfg, spread=spread)
        )  # fmt: skip
    return rows


def tune_extend(
    timer: Timer, matmul_rate: float, page_size: int, kv_dtype: torch.dtype = DTYPE
) -> list[Row]:
    from minisgl.kernels.attention.extend import ExtendConfig

    ext = functools.partial(run_extend, kv_dtype=kv_dtype)
    rows = []
    shapes = [(1, 8192, 0), (16, 1024, 2048)]
    for (r, n, c), bm, bn, w, st in itertools.product(
        shapes, (64, 128), (32, 64, 128), (4, 8), (2, 3)
    ):
        cfg = ExtendConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
        label = {"requests": r, "new_tokens": n, "cached": c, "block_m": bm, "block_n": bn,
                 "num_warps": w, "num_stages": st}  # fmt: skip
        rows.append(_attempt(label, ext, r, n, c, page_size, timer, matmul_rate, config=cfg))
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
MIXED_COLUMNS = ["decode_rows", "context", "prompt", "bucket", "num_splits", "rows_wide",
                 "block_n", "block_n_narrow", "num_warps", "num_stages", "mixed_us", "pair_us",
                 "mixed_fraction_of_copy", "pair_fraction_of_copy", "mixed_host_us",
                 "pair_host_us", "rel_err", "padding_zero"]
EXTEND_COLUMNS = ["requests", "new_tokens", "cached", "block_m", "block_n", "num_warps",
                  "num_stages", "time_us", "flop_per_s", "fraction_of_matmul", "rel_err"]
# fmt: on


def run_all(args: argparse.Namespace, timer: Timer) -> Row:
    copy_bw = measure_copy_bandwidth(timer)
    ps = args.page_size
    kv_dtype = KV_DTYPES[args.kv_cache_dtype]
    if args.fp8_gemm:
        print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s")
        return {"copy_bytes_per_s": copy_bw, **fp8_gemm_sweep(timer)}
    if args.mixed:  # only the mixed-step comparison (and its tile sweep with --tune)
        print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s")
        return {"copy_bytes_per_s": copy_bw, **run_mixed_all(args, timer, copy_bw)}
    if args.w1:  # only the W1-shape sweep
        rows = sorted(
            tune_w1_decode(timer, copy_bw, ps, kv_dtype),
            key=lambda r: (r["batch"], r.get("time_us", math.inf)),
        )
        print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s")
        print_table("W1-like ragged decode batches", rows, DECODE_COLUMNS)
        return {"copy_bytes_per_s": copy_bw, "tune_w1_decode": rows}
    dec = functools.partial(run_decode, kv_dtype=kv_dtype, heads=args.decode_heads)
    ext = functools.partial(run_extend, kv_dtype=kv_dtype)
    matmul_rate = measure_matmul_rate(timer)
    print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s, bf16 matmul {matmul_rate / 1e12:.1f} TFLOP/s")
    decode = [
        _attempt({"batch": b, "context": c}, dec, b, c, ps, timer, copy_bw)
        for b, c in itertools.product(args.decode_batches, args.decode_contexts)
    ]
    print_table(f"decode attention (page_size {ps}, {args.kv_cache_dtype} KV)", decode,
                DECODE_COLUMNS)  # fmt: skip
    result: Row = {"copy_bytes_per_s": copy_bw, "matmul_flop_per_s": matmul_rate, "decode": decode}
    if args.tune:  # the decode sweep first: with --decode-only it is all that runs
        if kv_dtype == torch.float8_e4m3fn:
            result["tune_decode"] = tune_decode_fp8(timer, copy_bw, ps)
        else:
            result["tune_decode"] = tune_decode(timer, copy_bw, ps, kv_dtype)
            print_table("tune: decode", result["tune_decode"], DECODE_COLUMNS)
    if args.decode_only:
        return result
    b, c = PAGE_SWEEP_SHAPE
    sweep = [_attempt({"page_size": p}, dec, b, c, p, timer, copy_bw) for p in PAGE_SIZES]
    print_table(f"decode page-size sweep (batch {b} x {c})", sweep, DECODE_COLUMNS)
    extend = [
        _attempt({"requests": r, "cached": c}, ext, r, n, c, ps, timer, matmul_rate)
        for (r, n), c in itertools.product(EXTEND_SHAPES, EXTEND_CACHED)
    ]
    print_table(f"extend attention (page_size {ps})", extend, EXTEND_COLUMNS)
    result |= {"decode_page_size_sweep": sweep, "extend": extend}
    if args.tune:
        result["tune_extend"] = tune_extend(timer, matmul_rate, ps, kv_dtype)
        print_table("tune: extend", result["tune_extend"], EXTEND_COLUMNS)
    return result


# ---- FP8 linear layers: where the weight-only GEMV stops paying --------------------------------

# Llama-3-8B's projections (N, K): qkv, o_proj, gate/up, down.
FP8_GEMM_SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
FP8_GEMM_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256)
WEIGHT_ROTATION_BYTES = 600 << 20  # weight copies cycled through, so L2 never holds them


def fp8_gemm_sweep(timer: Timer) -> Row:
    """us per call of a bf16 `F.linear`, the FP8 weight-only GEMV and the FP8 tensor-core GEMM
    (`fp8_linear`: activation quantization + cuBLASLt row-wise scaled GEMM) for each shape and
    row count; the switch point is the largest row count up to which the GEMV wins for a whole
    layer (the four projections summed) every time."""
    from minisgl.kernels.fp8 import quantize_rows

    rows: list[Row] = []
    for n, k in FP8_GEMM_SHAPES:
        sets = max(2, math.ceil(WEIGHT_ROTATION_BYTES / (n * k)))
        w16 = [torch.randn(n, k, device=DEVICE, dtype=DTYPE) / k**0.5 for _ in range(sets)]
        w8 = [quantize_rows(w) for w in w16]
        rows += [_time_linears(timer, m, w16[: max(2, sets // 2)], w8) for m in FP8_GEMM_ROWS]
        torch.cuda.empty_cache()
    print_table("FP8 linear: weight-only GEMV vs tensor-core GEMM (us per call)", rows,
                ["n", "k", "m", "bf16_us", "fp8_gemv_us", "fp8_gemm_us", "gemv_weight_tb_s",
                 "gemm_weight_tb_s"])  # fmt: skip
    switch = 0
    for m in FP8_GEMM_ROWS:
        per_layer = [r for r in rows if r["m"] == m]
        if sum(r["fp8_gemv_us"] for r in per_layer) > sum(r["fp8_gemm_us"] for r in per_layer):
            break
        switch = m
    print(f"\nFP8_GEMV_MAX_ROWS = {switch}  # minisgl/config/quant.py: the GEMV wins up to here")
    return {"fp8_gemm": rows, "fp8_gemv_max_rows": switch}


def _time_linears(
    timer: Timer,
    m: int,
    w16: list[torch.Tensor],  # bf16 copies [N, K] (half as many: twice the bytes each)
    w8: list[tuple[torch.Tensor, torch.Tensor]],  # (e4m3 [N, K], fp32 [N]) copies
) -> Row:
    import torch.nn.functional as F

    from minisgl.kernels.fp8.gemm import fp8_linear
    from minisgl.kernels.gemv.gemv import gemv

    n, k = w16[0].shape
    x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
    t16 = timer(lambda i: F.linear(x, w16[i]), len(w16))
    tg = timer(lambda i: gemv(x, w8[i][0], weight_scale=w8[i][1]), len(w8))
    tm = timer(lambda i: fp8_linear(x, w8[i][0], w8[i][1]), len(w8))
    return {
        "n": n, "k": k, "m": m, "bf16_us": t16 * 1e6, "fp8_gemv_us": tg * 1e6,
        "fp8_gemm_us": tm * 1e6, "gemv_weight_tb_s": n * k / tg / 1e12,
        "gemm_weight_tb_s": n * k / tm / 1e12,
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-size", type=int, default=16, help="page size of the main tables")
    parser.add_argument("--tune", action="store_true", help="also sweep tiles and split counts")
    parser.add_argument(
        "--w1",
        action="store_true",
        help="only sweep decode tiles and splits on W1-like ragged batches",
    )
    parser.add_argument("--kv-cache-dtype", default="bfloat16", choices=list(KV_DTYPES))
    ints = lambda v: [int(t) for t in v.split(",")]  # noqa: E731
    parser.add_argument("--decode-batches", type=ints, default=list(DECODE_BATCHES))
    parser.add_argument("--decode-contexts", type=ints, default=list(DECODE_CONTEXTS))
    parser.add_argument("--decode-only", action="store_true", help="only the decode table")
    parser.add_argument(
        "--decode-heads",
        type=lambda v: Heads(*ints(v)),
        default=Heads(),
        metavar="Q,KV,D",
        help="the decode tables' query heads, KV heads and head dim (default: W3's "
        f"{NUM_Q_HEADS},{NUM_KV_HEADS},{HEAD_DIM}); e.g. bf16 at D 64 reads 128-byte rows "
        "per token and head as e4m3 at D 128 does",
    )
    parser.add_argument(
        "--fp8-gemm",
        action="store_true",
        help="only the FP8 GEMV-vs-GEMM sweep that sets FP8_GEMV_MAX_ROWS",
    )
    parser.add_argument(
        "--mixed",
        action="store_true",
        help="only mixed steps (decode rows beside a prompt, issue 23): the one-launch mixed "
        "kernel against decode-split + extend; with --tune, its tile sweep",
    )
    parser.add_argument(
        "--mixed-max-requests",
        type=int,
        default=MIXED_MAX_REQUESTS,
        help="request capacity of the mixed kernel's launch (its grid and tables)",
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
        "kv_cache_dtype": args.kv_cache_dtype,
        "num_q_heads": NUM_Q_HEADS,
        "num_kv_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "decode_heads": list(args.decode_heads),
    }
    print(
        f"W3 attention kernels on {header['device']} (torch {torch.__version__}, "
        f"triton {triton.__version__})"
    )
    result = run_all(args, time_graph)
    print(json.dumps({**header, **result}))


if __name__ == "__main__":
    main()
