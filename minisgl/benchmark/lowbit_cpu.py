"""torch's CPU weight-only ops against fp32 `F.linear` at SmolLM2-135M's shapes (one thread):

python -m minisgl.benchmark.lowbit_cpu [--rows 1 8 32 128 256] [--repeat 20]

Columns, microseconds per call, the best of `--repeat` thread-CPU-time runs (a loaded, shared
machine only ever slows a run down): fp32 and bf16 `F.linear`, `_weight_int4pack_mm_for_cpu`
with bf16 and fp32 activations (group 32), `_weight_int8pack_mm` with bf16 activations (per
channel), `_dyn_quant_matmul_4bit` (fp32 activations quantized per token; where it runs). One weight repeated,
so the decoder layers' weights sit in cache: in a model they stream from memory, as the LM
head's do here. Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# SmolLM2-135M: hidden 576, intermediate 1536, 9 heads / 3 KV heads of 64, vocab 49152.
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
          "lm_head": (576, 49152)}  # fmt: skip
GROUP = 32


def best_us(fn: Callable[[], Any], repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t)
    return best * 1e6


def ops(k: int, n: int) -> dict[str, Callable[[torch.Tensor], Any]]:
    aten = torch.ops.aten
    w = torch.randn(n, k) * 0.02
    wb = w.bfloat16()
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    packed = aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.rand(k // GROUP, n, 2)
    q8, s8 = torch.randint(-128, 127, (n, k), dtype=torch.int8), torch.rand(n)
    table = {
        "fp32": lambda x: F.linear(x, w),
        "bf16": lambda x: F.linear(x.bfloat16(), wb),
        "int4 bf16-x": lambda x: aten._weight_int4pack_mm_for_cpu(
            x.bfloat16(), packed, GROUP, sz.bfloat16()
        ),  # fmt: skip
        "int4 fp32-x": lambda x: aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz),
        "int8 bf16-x": lambda x: aten._weight_int8pack_mm(x.bfloat16(), q8, s8.bfloat16()),
    }
    try:  # KleidiAI (Arm) packs; elsewhere torch 2.13 refuses the bias of an x86 packing
        dyn = aten._dyn_quant_pack_4bit_weight(
            q.to(torch.uint8), torch.rand(n, k // GROUP), torch.zeros(n), GROUP, k, n
        )
        dyn_mm = aten._dyn_quant_matmul_4bit
        dyn_mm(torch.randn(1, k), dyn, GROUP, k, n)
        table["dyn-quant 4bit"] = lambda x: dyn_mm(x, dyn, GROUP, k, n)
    except RuntimeError as e:
        print(f"_dyn_quant_matmul_4bit: {e}")
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    for name, (k, n) in SHAPES.items():
        table = ops(k, n)
        for m in args.rows if name != "lm_head" else [r for r in args.rows if r <= 8]:
            x = torch.randn(m, k)
            times = {op: best_us(functools.partial(f, x), args.repeat) for op, f in table.items()}
            row = {"shape": name, "M": m, **times}
            rows.append(row)
            print("  ".join(f"{v:>9.1f}" if isinstance(v, float) else f"{v!s:>8}" for v in row.values()), flush=True)  # fmt: skip
    print("columns:", ", ".join(rows[0]))
    print(json.dumps({"benchmark": "lowbit_cpu", "us": rows}))


if __name__ == "__main__":
    main()
