"""`python -m minisgl.benchmark.tune KERNEL [options]`: the package docstring says what each
kernel's sweep sets."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from minisgl.benchmark.common import Row, emit_json
from minisgl.benchmark.kernels import KV_DTYPES

KERNELS = ("gemv", "skinny", "fp8-gemm", "decode", "extend", "mixed", "moe", "moe-fp8", "w8a8")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from minisgl.benchmark.tune import __doc__ as doc

    ints = lambda v: [int(t) for t in v.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser(prog="python -m minisgl.benchmark.tune", description=doc)
    ap.add_argument("kernel", choices=KERNELS)
    ap.add_argument("--quick", action="store_true", help="gemv, skinny: fewer configs")
    ap.add_argument("--fp8", action="store_true", help="gemv: e4m3 weights, a scale per row")
    ap.add_argument(
        "--only", default="", help="gemv, skinny: shape name prefixes (8b,30b,0.6b,135m)"
    )
    ap.add_argument("--page-size", type=int, default=16, help="decode, extend, mixed")
    ap.add_argument("--kv-cache-dtype", default="bfloat16", choices=list(KV_DTYPES))
    ap.add_argument("--mixed-max-requests", type=int, default=256, help="mixed: request capacity")
    ap.add_argument("--tokens", type=ints, default=None, help="moe, moe-fp8: token counts")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> list[Row]:
    from minisgl.benchmark.tune import attention, linear, moe

    only = [o for o in args.only.split(",") if o]
    kv = KV_DTYPES[args.kv_cache_dtype]
    tokens = args.tokens or list(moe.TOKENS)
    tuners = {
        "gemv": lambda: linear.tune_gemv(args.quick, args.fp8, only),
        "skinny": lambda: linear.tune_skinny(args.quick, only),
        "fp8-gemm": linear.tune_fp8_gemm,
        "decode": lambda: attention.tune_decode(args.page_size, kv),
        "extend": lambda: attention.tune_extend(args.page_size, kv),
        "mixed": lambda: attention.tune_mixed(args.page_size, kv, args.mixed_max_requests),
        "moe": lambda: moe.tune_moe(args.seed, tokens),
        "moe-fp8": lambda: moe.tune_moe_fp8(args.seed, tokens),
        "w8a8": lambda: moe.tune_w8a8(args.seed),
    }
    return tuners[args.kernel]()  # type: ignore[no-untyped-call]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmark.tune needs a CUDA GPU; none is visible here.", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    emit_json({"tune": args.kernel, "gpu": torch.cuda.get_device_name(), "rows": run(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
