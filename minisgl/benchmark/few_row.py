"""The few-row GEMV tuner: the fused GEMV's few-row mode (`minisgl.kernels.gemv.few_row_gemv`,
one program for all M rows of x per weight tile, CUDA cores) at M rows, beside cuBLAS
(`F.linear` at M rows, bf16, the plain product) and the skinny tensor-core GEMM
(`minisgl.kernels.skinny`, its default config) at the same M, and the one-row GEMV at M = 1 for
scale, on the decode shapes of `minisgl.benchmark.skinny.SHAPES` with the fused prologue /
epilogue the model uses there. Each timed as a CUDA graph of back-to-back calls over weight
copies of >= 600 MB (L2 never holds them).

Per shape: a sweep of few-row configs (BLOCK_N, BLOCK_K, warps; every one with BLOCK_K / 8 >=
32 x warps, the layout the kernel needs), microseconds and TB/s of weight bytes for each kernel,
the error of the best config against fp32 torch; then per model the decoder layer's four
projections summed (what a verify step's layers cost), and the `ROWS_CONFIGS` entry to paste
into `minisgl/kernels/gemv.py` (the config with the best layer sum). The last line is one JSON
object.

Run on the H200 (a verify step of K = 4 drafts is 5 rows, padded to 8 in a CUDA graph):
    python -m minisgl.benchmark.gemv --rows 5 --only 8b --quick
    python -m minisgl.benchmark.gemv --rows 8 --only 8b
    python -m minisgl.benchmark.gemv --rows 8 --only 8b --fp8     # e4m3, a scale per row
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from minisgl.benchmark.common import Row, print_table
from minisgl.benchmark.skinny import SHAPES, Probe


def sweep_configs(rows: int, quick: bool) -> list[Any]:
    """Few-row configs to sweep at `rows` rows of x (the default among them): weight rows per
    program, columns per step (BLOCK_K / 8 >= 32 x warps), x read ahead or at its step."""
    from minisgl.kernels.gemv import GemvConfig, default_rows_config

    padded = 1 << (rows - 1).bit_length()
    default = default_rows_config(padded)
    big = padded >= 8
    if quick:  # (weight rows, x ahead) at 1024 columns and 4 warps, and one of 8 warps
        pairs = [(2, False), (4, True), (4, False), (8, False)] if big else [(8, True), (16, True), (16, False), (32, False)]  # fmt: skip
        tiles = [(bn, 1024, 4, ahead) for bn, ahead in pairs] + [(default.block_n, 2048, 8, default.x_ahead)]  # fmt: skip
    else:
        tiles = [
            (bn, bk, w, ahead)
            for bn, bk, w, ahead in itertools.product(
                (2, 4, 8, 16, 32), (512, 1024, 2048), (2, 4, 8), (True, False)
            )
            if bk // 8 >= 32 * w
            and bk // 8 <= 64 * w  # one or two 8-column pieces a thread
            and padded * bn <= 128  # (the partial sums alone would take every register)
        ]
    configs = [GemvConfig(bn, bk, w, x_ahead=ahead) for bn, bk, w, ahead in tiles]
    return configs + [default] if default not in configs else configs


def _label(c: Any) -> str:
    return f"{c.block_n}x{c.block_k} w{c.num_warps} {'ahead' if c.x_ahead else 'at'}"


def probe_shape(name: str, n: int, k: int, kind: str, fmt: str, rows: int, quick: bool) -> Row:
    """One shape at `rows` rows: every kernel's time, the sweep's times under "sweep"."""
    from minisgl.kernels.gemv import few_row_gemv
    from minisgl.kernels.skinny import default_config as skinny_config

    p = Probe(n, k, kind, fmt)
    x, r = p.inputs(rows)
    weight_mb = n * k * (2 if fmt == "bf16" else 1) / 1e6
    sweep = {_label(c): p.kernel_us(few_row_gemv, x, r, c) for c in sweep_configs(rows, quick)}
    best = min(sweep, key=lambda label: sweep[label])
    configs = {_label(c): c for c in sweep_configs(rows, quick)}
    row: Row = {"gemm": name, "N": n, "K": k, "M": rows, "MB": round(weight_mb, 1)}
    row["cublas_us"] = p.cublas_us(x)
    row["skinny_us"] = p.skinny_us(x, r, skinny_config(n, k, kind == "act_residual", fmt))
    row["few_row_us"] = sweep[best]
    row["gemv_us_at_1"] = p.gemv_us(x[:1], r[:1])
    for key in ("cublas", "skinny", "few_row"):
        row[f"{key}_TBps"] = weight_mb / row[f"{key}_us"]
    row["rel_err"] = p.rel_err(x, r, configs[best], few_row_gemv)
    row["best"] = best
    row["sweep"] = sweep
    print(f"{name} at M={rows}: " + ", ".join(f"{lab} {us:.1f}" for lab, us in sorted(sweep.items(), key=lambda t: t[1])[:4]), flush=True)  # fmt: skip
    del p
    torch.cuda.empty_cache()
    return row


def layer_sums(rows: list[Row]) -> Row:
    """Per model prefix, the decoder layer's projections (LM head left out) summed for each
    kernel, and the few-row config with the best sum (one config for every shape)."""
    out: Row = {}
    for prefix in sorted({r["gemm"].split()[0] for r in rows}):
        layer = [r for r in rows if r["gemm"].startswith(prefix + " ") and "lm_head" not in r["gemm"]]  # fmt: skip
        if not layer:
            continue
        for key in ("cublas_us", "skinny_us", "few_row_us", "gemv_us_at_1"):
            out[f"{prefix}_layer_{key}"] = sum(r[key] for r in layer)
        common = set.intersection(*(set(r["sweep"]) for r in layer))
        one = min(common, key=lambda c: sum(r["sweep"][c] for r in layer))
        out[f"{prefix}_layer_one_config"] = one
        out[f"{prefix}_layer_one_config_us"] = sum(r["sweep"][one] for r in layer)
    return out


def run(fmt: str, rows: int, quick: bool, only: Sequence[str] = ()) -> Row:
    """The few-row sweep at `rows` rows for one weight format; prints tables, returns figures."""
    if not torch.cuda.is_available():
        raise SystemExit("the few-row GEMV sweep needs a CUDA GPU; none is visible here.")
    from minisgl.config.quant import FEW_ROW_GEMV_MAX_ROWS

    if not 2 <= rows <= FEW_ROW_GEMV_MAX_ROWS:
        raise SystemExit(f"--rows: the few-row GEMV takes 2..{FEW_ROW_GEMV_MAX_ROWS} rows")
    torch.manual_seed(0)
    out: list[Row] = []
    for name, (n, k, kind) in SHAPES.items():
        if (only and not any(name.startswith(o) for o in only)) or (fmt != "bf16" and "lm_head" in name):  # fmt: skip
            continue  # (an FP8 model keeps its LM head in 16 bits)
        out.append(probe_shape(name, n, k, kind, fmt, rows, quick))
    columns = ["gemm", "M", "MB", "cublas_us", "skinny_us", "few_row_us", "gemv_us_at_1",
               "cublas_TBps", "skinny_TBps", "few_row_TBps", "rel_err", "best"]  # fmt: skip
    print_table(f"few-row GEMV at {rows} rows, {fmt} weights (us; TB/s of weight bytes)", out, columns)  # fmt: skip
    sums = layer_sums(out)
    print("\ndecoder layer (qkv + o_proj + gate_up + down), us:")
    for key, value in sums.items():
        print(f"  {key}: {value if isinstance(value, str) else round(value, 2)}")
    padded = 1 << (rows - 1).bit_length()
    for key, value in sums.items():
        if key.endswith("_layer_one_config"):
            bn, rest = value.split("x")
            bk, rest = rest.split(" w")
            warps, ahead = rest.split()
            print(f"# {key[: -len('_layer_one_config')]}: ROWS_CONFIGS[{padded}] = GemvConfig({bn}, {bk}, {warps}, x_ahead={ahead == 'ahead'})")  # fmt: skip
    return {"format": fmt, "rows": rows, "shapes": out, "layer": sums}
