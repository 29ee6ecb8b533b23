"""W3, the attention-kernel benchmark (BENCHMARKS.md): `python -m minisgl.benchmark.kernels`.

On one CUDA GPU, in one run: device-to-device copy bandwidth, the bf16 matmul rate, paged decode
attention (achieved bytes/s against the copy bandwidth) and paged extend attention (FLOP/s
against the matmul rate), each checked against the torch reference. Every figure is the median
over replays of a CUDA graph of back-to-back calls; small cases cycle through enough distinct
inputs that they do not sit in L2. Prints tables, then one JSON object as the last line.
`--kv-cache-dtype fp8_e4m3` runs the attention on an e4m3 pool (bytes counted at one per value,
plus the per-head scales). `--mixed` runs only mixed steps (decode rows beside one prompt,
W4-like): the one-launch `mixed_attention` at the step's token bucket, its fraction of the copy
bandwidth (every context's K/V read once) and its error. The kernels' tile sweeps are
`python -m minisgl.benchmark.tune decode|extend|mixed`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from minisgl.benchmark import common
from minisgl.benchmark.common import Row
from minisgl.kernels.attention.reference import decode_attention_ref, extend_attention_ref
from minisgl.kernels.attention.testing import cu_seqlens, random_paged_kv

# W1's head layout (Qwen3-0.6B).
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128


DTYPE = torch.bfloat16
SM_SCALE = HEAD_DIM**-0.5
DECODE_BATCHES = (1, 32, 256)
DECODE_CONTEXTS = (512, 1024, 4096, 32768)
EXTEND_SHAPES = ((1, 8192), (16, 1024))  # (requests, new tokens of each)
EXTEND_CACHED = (0, 2048)
REF_REQUESTS = 4  # requests of each case checked against the torch reference
MAX_INPUT_SETS = 64

DEVICE = "cuda"
KV_DTYPES = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}


def _l2_bytes() -> int:
    return torch.cuda.get_device_properties(DEVICE).L2_cache_size


def measure_matmul_rate(n: int = 8192) -> float:
    """FLOP/s of an n x n x n bf16 matmul."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=DEVICE)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=DEVICE)
    c = torch.empty_like(a)
    seconds = common.time_graph(lambda _: torch.matmul(a, b, out=c), 1)
    return 2 * n**3 / seconds


def _tile(cfg: Any, prefix: str = "") -> Row:
    """A kernel config's fields as table columns (those starting with `prefix`)."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k.startswith(prefix)}


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
) -> DecodeCase:
    """Every request at `context` tokens on randomly scattered pages; with `spread` s, contexts
    drawn uniformly from [context * (1 - s), context * (1 + s)] (ragged, like a continuous
    batch)."""
    elem = torch.empty((), dtype=kv_dtype).element_size()  # 1 for e4m3
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * elem
    n_sets = max(1, min(MAX_INPUT_SETS, math.ceil(4 * _l2_bytes() / kv_bytes)))
    lo, hi = round(context * (1 - spread)), round(context * (1 + spread))
    gen = torch.Generator().manual_seed(batch * 7 + context)
    contexts = torch.randint(lo, hi + 1, (n_sets, batch), generator=gen)
    contexts[:, 0] = hi
    kv = random_paged_kv(
        contexts.flatten().tolist(), page_size, NUM_KV_HEADS, HEAD_DIM, kv_dtype, DEVICE,
        poison=False,
    )  # fmt: skip
    kv_bytes = 2 * int(contexts[0].sum()) * NUM_KV_HEADS * HEAD_DIM * elem
    scale_bytes = 2 * NUM_KV_HEADS * 4 if kv.kv_scales is not None else 0  # fp32 per KV head
    qo_bytes = 2 * batch * NUM_Q_HEADS * HEAD_DIM * torch.empty((), dtype=DTYPE).element_size()
    q = torch.randn(n_sets, batch, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    tables, lens = kv.block_table.view(n_sets, batch, -1), kv.seq_lens.view(n_sets, batch)
    return DecodeCase(kv, tables, lens, q, hi, kv_bytes + scale_bytes + qo_bytes)


def run_decode(
    batch: int,
    context: int,
    page_size: int,
    copy_bw: float,
    *,
    num_splits: int | None = None,
    config: Any = None,
    spread: float = 0.0,
    kv_dtype: torch.dtype = DTYPE,
) -> Row:
    """Decode attention over `decode_case(...)`: achieved bytes/s against the copy bandwidth."""
    from minisgl.kernels.attention.decode import (
        choose_num_splits,
        decode_attention,
        default_decode_config,
    )
    from minisgl.kernels.common import num_sms

    case = decode_case(batch, context, page_size, spread, kv_dtype)
    kv, tables, lens, q = case.kv, case.tables, case.lens, case.q
    out = torch.empty_like(q)
    cfg = config or default_decode_config(HEAD_DIM, kv_dtype == torch.float8_e4m3fn)
    splits = num_splits or choose_num_splits(
        batch, NUM_KV_HEADS, case.max_len, num_sms(q.device), cfg
    )

    caches, tile = (kv.k_cache, kv.v_cache), dict(config=cfg, kv_scales=kv.kv_scales)

    def call(i: int) -> None:
        decode_attention(q[i], *caches, tables[i], lens[i], page_size, SM_SCALE,
                         num_splits=splits, out=out[i], **tile)  # fmt: skip

    seconds = common.time_graph(call, q.shape[0])
    call(0)
    rows = min(batch, REF_REQUESTS)
    expected = decode_attention_ref(q[0, :rows], *caches, tables[0, :rows], lens[0, :rows],
                                    page_size, SM_SCALE, kv.kv_scales)  # fmt: skip
    bytes_per_s = case.nbytes / seconds
    return {
        "batch": batch, "context": context, "kv_dtype": str(kv_dtype).removeprefix("torch."),
        "spread": spread, "page_size": page_size, "num_splits": splits,
        "block_n": cfg.block_n if splits > 1 else cfg.block_n_unsplit, **_tile(cfg, "num_"),
        "time_us": seconds * 1e6, "bytes_per_s": bytes_per_s,
        "fraction_of_copy": bytes_per_s / copy_bw, **_errors(out[0, :rows], expected),
    }  # fmt: skip


def run_extend(
    num_reqs: int,
    new_tokens: int,
    cached: int,
    page_size: int,
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
    seconds = common.time_graph(
        lambda _: extend_attention(q, *args, new_tokens, config=cfg, out=out, kv_scales=scales), 1
    )
    # Query at position p sees p + 1 keys: QK^T and PV are 2 * D FLOPs per (query, key, head) each.
    visible = num_reqs * (new_tokens * cached + new_tokens * (new_tokens + 1) // 2)
    flops = 4 * NUM_Q_HEADS * HEAD_DIM * visible
    n = min(num_reqs, 2)
    rows = n * new_tokens
    expected = extend_attention_ref(q[:rows], *args[:2], kv.block_table[:n], kv.seq_lens[:n],
                                    ext[:n], cu[: n + 1], page_size, SM_SCALE, kv.kv_scales)  # fmt: skip
    return {
        "requests": num_reqs, "new_tokens": new_tokens, "cached": cached, "page_size": page_size,
        **_tile(cfg), "time_us": seconds * 1e6, "flop_per_s": flops / seconds,
        "fraction_of_matmul": flops / seconds / matmul_rate, **_errors(out[:rows], expected),
    }  # fmt: skip


# ---- mixed steps: decode rows beside one prompt, in one launch ---------------------------------

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
    copy_bw: float,
    *,
    num_splits: int = 1,
    config: Any = None,
    max_requests: int = MIXED_MAX_REQUESTS,
    kv_dtype: torch.dtype = DTYPE,
) -> Row:
    """One mixed step's attention (one layer) by `mixed_attention` at the step's token bucket,
    timed in a CUDA graph, against the torch reference; the bucket's padding must stay zero."""
    from minisgl.kernels.attention.mixed import default_mixed_config, mixed_attention

    nd, ctx, prompt = shape
    case = mixed_case(nd, ctx, prompt, page_size, max_requests, kv_dtype)
    kv, q, cu = case.kv, case.q, case.cu
    t, b = nd + prompt, nd + 1
    cfg = config or default_mixed_config(HEAD_DIM)
    out = torch.empty_like(q)
    caches = (kv.k_cache, kv.v_cache)

    def mixed(_: int) -> None:
        mixed_attention(q, *caches, kv.block_table, kv.seq_lens, cu, page_size, SM_SCALE,
                        num_splits=num_splits, config=cfg, out=out, kv_scales=kv.kv_scales)  # fmt: skip

    seconds = common.time_graph(mixed, 1)
    mixed(0)
    expected = extend_attention_ref(q[:t], *caches, kv.block_table[:b], kv.seq_lens[:b],
                                    cu[1 : b + 1] - cu[:b], cu[: b + 1], page_size, SM_SCALE,
                                    kv.kv_scales)  # fmt: skip
    return {
        "decode_rows": nd, "context": ctx, "prompt": prompt, "tokens": t, "bucket": q.shape[0],
        "max_requests": max_requests, "num_splits": num_splits, **_tile(cfg),
        "mixed_us": seconds * 1e6,
        "mixed_fraction_of_copy": case.nbytes / seconds / copy_bw,
        "padding_zero": bool((out[t:] == 0).all()), **_errors(out[:t], expected),
    }  # fmt: skip


def run_mixed_all(args: argparse.Namespace, copy_bw: float) -> Row:
    kv_dtype = KV_DTYPES[args.kv_cache_dtype]
    ps = args.page_size
    run = functools.partial(run_mixed, max_requests=args.mixed_max_requests, kv_dtype=kv_dtype)
    rows = [
        common.attempt({"decode_rows": shape[0], "context": shape[1], "prompt": shape[2],
                 "num_splits": splits}, run, shape, ps, copy_bw, num_splits=splits)
        for shape, splits in itertools.product(MIXED_SHAPES, MIXED_SPLITS)
    ]  # fmt: skip
    common.print_table(f"mixed steps, one launch (page_size {ps}, {args.kv_cache_dtype} KV; us of one "
                "layer)", rows, MIXED_COLUMNS)  # fmt: skip
    return {"mixed": rows}


# fmt: off
DECODE_COLUMNS = ["batch", "context", "page_size", "num_splits", "block_n", "num_warps",
                  "num_stages", "time_us", "bytes_per_s", "fraction_of_copy", "rel_err", "error"]
MIXED_COLUMNS = ["decode_rows", "context", "prompt", "bucket", "num_splits", "rows_wide",
                 "block_n", "block_n_narrow", "num_warps", "num_stages", "mixed_us",
                 "mixed_fraction_of_copy", "rel_err", "padding_zero", "error"]
EXTEND_COLUMNS = ["requests", "new_tokens", "cached", "block_m", "block_n", "num_warps",
                  "num_stages", "time_us", "flop_per_s", "fraction_of_matmul", "rel_err", "error"]
# fmt: on


def run_all(args: argparse.Namespace) -> Row:
    copy_bw = common.measure_bandwidth(torch.device(DEVICE))
    ps = args.page_size
    kv_dtype = KV_DTYPES[args.kv_cache_dtype]
    if args.mixed:  # only the mixed-step comparison
        print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s")
        return {"copy_bytes_per_s": copy_bw, **run_mixed_all(args, copy_bw)}
    dec = functools.partial(run_decode, kv_dtype=kv_dtype)
    ext = functools.partial(run_extend, kv_dtype=kv_dtype)
    matmul_rate = measure_matmul_rate()
    print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s, bf16 matmul {matmul_rate / 1e12:.1f} TFLOP/s")
    decode = [
        common.attempt({"batch": b, "context": c}, dec, b, c, ps, copy_bw)
        for b, c in itertools.product(args.decode_batches, args.decode_contexts)
    ]
    common.print_table(f"decode attention (page_size {ps}, {args.kv_cache_dtype} KV)", decode,
                DECODE_COLUMNS)  # fmt: skip
    result: Row = {
        "copy_bytes_per_s": copy_bw,
        "matmul_flop_per_s": matmul_rate,
        "decode": decode,
    }
    if args.decode_only:
        return result
    extend = [
        common.attempt({"requests": r, "cached": c}, ext, r, n, c, ps, matmul_rate)
        for (r, n), c in itertools.product(EXTEND_SHAPES, EXTEND_CACHED)
    ]
    common.print_table(f"extend attention (page_size {ps})", extend, EXTEND_COLUMNS)
    return result | {"extend": extend}


def main(argv: Sequence[str] | None = None) -> None:
    ints = lambda v: [int(t) for t in v.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--page-size", type=int, default=16, help="page size of the main tables")
    p.add_argument("--kv-cache-dtype", default="bfloat16", choices=list(KV_DTYPES))
    p.add_argument("--decode-batches", type=ints, default=list(DECODE_BATCHES))
    p.add_argument("--decode-contexts", type=ints, default=list(DECODE_CONTEXTS))
    p.add_argument("--decode-only", action="store_true", help="only the decode table")
    p.add_argument("--mixed", action="store_true", help="only mixed steps (see above)")
    p.add_argument("--mixed-max-requests", type=int, default=MIXED_MAX_REQUESTS,
                   help="request capacity of the mixed kernel's launch (its grid and tables)")  # fmt: skip
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("minisgl.benchmark.kernels needs a CUDA GPU; none is visible here.")
    torch.manual_seed(0)
    device = torch.device(DEVICE)
    header = {"workload": "W3", **common.device_info(device), "dtype": "bfloat16",
              "kv_cache_dtype": args.kv_cache_dtype, "num_q_heads": NUM_Q_HEADS,
              "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM}  # fmt: skip
    print(f"W3 attention kernels on {header['device']} (torch {header['torch']}, "
          f"triton {header.get('triton')})")  # fmt: skip
    common.emit_json({**header, **run_all(args)})


if __name__ == "__main__":
    main()
