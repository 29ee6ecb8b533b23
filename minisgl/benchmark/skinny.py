"""The skinny-GEMM tuner: the tensor-core GEMM for 1..16 rows of x (`minisgl.kernels.gemv.skinny`)
against cuBLAS, the fused GEMV and the FP8 tensor-core GEMM, at the decode shapes of Llama-3-8B
and Qwen3-0.6B, and the numbers that set its switches.

For each shape (with the fused prologue / epilogue the model uses there: the norm before qkv
and gate/up, the residual after o_proj and down, SiLU in down's prologue) and each row count M
in 1, 2, 4, 5, 8, 9, 16, timed as CUDA graphs of back-to-back calls over weight copies of
>= 600 MB (L2 never holds them): cuBLAS `F.linear` (bf16, the plain product), the GEMV (bf16:
at one row, as the model runs it; FP8: at every M, the weight-only path up to
`fp8_gemv_max_rows`), the FP8 tensor-core GEMM (`fp8_linear`, FP8 only), and the skinny
kernel: a sweep of configs (the default among them) at M = 5 (a verify step of 4 drafts; the
best again with its first weight tile loaded after the PDL wait), then the best and the default
config at every M. Prints microseconds and TB/s of weight bytes per shape and M, a `TUNED`
table to paste into `minisgl/kernels/gemv/skinny.py`, and the switches: the largest M up to which
the skinny kernel beats cuBLAS for a whole decoder layer at every M from 2 (for
`SKINNY_MAX_HIDDEN` in `minisgl/config/quant.py`); FP8: whether it beats the GEMV (`fp8_skinny`) and up to which M
the weight-only kernels beat the FP8 GEMM (`FP8_GEMV_MAX_ROWS`). The last line is one JSON
object.

Run on the H200 (about two minutes each, compiles included):
    python -m minisgl.benchmark.gemv --skinny --quick            # bf16
    python -m minisgl.benchmark.gemv --skinny --quick --fp8      # e4m3, a scale per row
    python -m minisgl.benchmark.gemv --skinny --quick --fp8-block  # e4m3, 128 x 128 blocks
(`python -m minisgl.benchmark.skinny` takes the same flags; drop `--quick` for a wider sweep.)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from minisgl.benchmark.common import Row, emit_json, print_table, time_graph

# name -> (N, K, how the model calls it)
SHAPES = {
    "8b qkv": (6144, 4096, "norm"),
    "8b o_proj": (4096, 4096, "residual"),
    "8b gate_up": (28672, 4096, "norm"),
    "8b down act": (4096, 14336, "act_residual"),
    "8b lm_head": (128256, 4096, "plain"),
    "0.6b qkv": (4096, 1024, "norm"),
    "0.6b o_proj": (1024, 2048, "residual"),
    "0.6b gate_up": (6144, 1024, "norm"),
    "0.6b down act": (1024, 3072, "act_residual"),
    "0.6b lm_head": (151936, 1024, "plain"),
    # SmolLM2-135M: its speculative verify steps (5-9 rows) are this kernel's main use
    "135m qkv": (960, 576, "norm"),
    "135m o_proj": (576, 576, "residual"),
    "135m gate_up": (3072, 576, "norm"),
    "135m down act": (576, 1536, "act_residual"),
    "135m lm_head": (49152, 576, "plain"),
}
ROWS = (1, 2, 4, 5, 8, 9, 16)
SWEEP_ROWS = 5  # a verify step of 4 drafts, batch 1
ROTATION_BYTES = 600 << 20
DEV = torch.device("cuda")
DT = torch.bfloat16
# A weight as the kernels take it: bf16 (scale None) or e4m3 with fp32 scales.
Weight = tuple[torch.Tensor, torch.Tensor | None]


def sweep_configs(n: int, k: int, fmt: str, quick: bool) -> list[Any]:
    """Tiles to sweep for one shape, each unsplit and with the split count that gives the SMs two
    programs each (at least 4 K steps a split). e4m3 weights are one byte: per-row scaled ones
    take twice the columns per step for the same bytes; block-scaled ones need 128."""
    from minisgl.kernels.gemv.skinny import SkinnyConfig

    tiles: list[tuple[int, int, int, int]] = [(32, 128, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3)]
    if fmt == "row":
        tiles = [(32, 256, 4, 4), (64, 256, 4, 4), (64, 512, 8, 3)]
    elif fmt == "block":
        tiles = [(32, 128, 4, 4), (64, 128, 4, 4), (64, 128, 4, 6)]
    if not quick:
        tiles += [(128, 128, 8, 4), (16, 256, 4, 4), (32, 128, 4, 6)]
        if fmt == "row":
            tiles += [(128, 256, 8, 3), (32, 512, 4, 3)]
    out = []
    for bn, bk, warps, stages in tiles:
        if fmt == "block" and bk != 128:
            continue
        n_tiles = -(-n // bn)
        split = max(1, min(8, -(-2 * 132 // n_tiles), k // (4 * bk)))
        for s in sorted({1, split}):
            out.append(SkinnyConfig(bn, bk, warps, stages, s))
    return out


def _weights(n: int, k: int, fmt: str) -> list[Weight]:
    from minisgl.kernels.fp8 import quantize_blocks, quantize_rows

    elem = 2 if fmt == "bf16" else 1
    sets = max(2, math.ceil(ROTATION_BYTES / (n * k * elem)))
    out: list[Weight] = []
    for _ in range(sets):
        w = torch.randn(n, k, device=DEV, dtype=DT) * k**-0.5
        if fmt == "row":
            out.append(quantize_rows(w))
        elif fmt == "block":
            out.append(quantize_blocks(w))
        else:
            out.append((w, None))
    return out


def _values(w: Weight, fmt: str) -> torch.Tensor:
    """The bf16 values a weight stands for (cuBLAS's operand)."""
    from minisgl.kernels.fp8 import dequantize_weight

    weight, scale = w
    if scale is None:
        return weight
    return dequantize_weight(weight, scale, 128 if fmt == "block" else None, DT)


class Probe:
    """One shape's weights and inputs, and timers for each kernel on them."""

    def __init__(self, n: int, k: int, kind: str, fmt: str) -> None:
        self.n, self.k, self.kind, self.fmt = n, k, kind, fmt
        self.ws = _weights(n, k, fmt)
        sets16 = 1 if fmt == "bf16" else 2  # half as many bf16 copies of FP8: the same bytes
        self.dense = [_values(w, fmt) for w in self.ws[: max(2, len(self.ws) // sets16)]]
        self.g = torch.rand(k, device=DEV, dtype=DT) + 0.5

    def inputs(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        act = self.kind == "act_residual"
        x = torch.randn(m, 2 * self.k if act else self.k, device=DEV, dtype=DT)
        return x, torch.randn(m, self.n, device=DEV, dtype=DT)

    def fused_kwargs(self, r: torch.Tensor) -> dict[str, Any]:
        if self.kind == "norm":
            return {"norm_weight": self.g}
        if self.kind == "residual":
            return {"residual": r}
        if self.kind == "act_residual":
            return {"residual": r, "act": True}
        return {}

    def skinny_us(self, x: torch.Tensor, r: torch.Tensor, cfg: Any) -> float:
        from minisgl.kernels.gemv.skinny import skinny

        kw = self.fused_kwargs(r)
        ws = self.ws
        return 1e6 * time_graph(lambda i: skinny(x, ws[i][0], config=cfg, weight_scale=ws[i][1], **kw), len(ws))  # fmt: skip

    def gemv_us(self, x: torch.Tensor, r: torch.Tensor) -> float:
        from minisgl.kernels.gemv.gemv import gemv

        kw = self.fused_kwargs(r)
        ws = self.ws
        return 1e6 * time_graph(lambda i: gemv(x, ws[i][0], weight_scale=ws[i][1], **kw), len(ws))

    def cublas_us(self, x: torch.Tensor) -> float:
        xk = x[:, : self.k].contiguous()
        dense = self.dense
        return 1e6 * time_graph(lambda i: F.linear(xk, dense[i]), len(dense))

    def fp8_gemm_us(self, x: torch.Tensor) -> float:
        from minisgl.kernels.fp8.gemm import fp8_linear

        xk = x[:, : self.k].contiguous()
        ws = self.ws
        return 1e6 * time_graph(lambda i: fp8_linear(xk, ws[i][0], ws[i][1]), len(ws))  # type: ignore[arg-type]

    def rel_err(self, x: torch.Tensor, r: torch.Tensor, cfg: Any) -> float:
        """The skinny GEMM's result against fp32 torch on the same values."""
        from minisgl.kernels.gemv.skinny import skinny

        xf = x.float()
        if self.kind == "act_residual":
            xf = F.silu(xf[:, : self.k]) * xf[:, self.k :]
        if self.kind == "norm":
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * self.g.float()
        want = xf @ _values(self.ws[0], self.fmt).float().t()
        if self.kind.endswith("residual"):
            want = want + r.float()
        w, s = self.ws[0]
        got = skinny(x, w, config=cfg, weight_scale=s, **self.fused_kwargs(r)).float()
        return ((got - want).abs().max() / want.abs().max()).item()


def _label(c: Any) -> str:
    return f"{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages} k{c.split_k}"


def probe_shape(name: str, n: int, k: int, kind: str, fmt: str, quick: bool) -> list[Row]:
    """One row per M for this shape; the chosen config rides along under "config"."""
    from minisgl.kernels.gemv.skinny import default_config

    p = Probe(n, k, kind, fmt)
    x, r = p.inputs(SWEEP_ROWS)
    default = default_config(n, k, kind == "act_residual", fmt)
    configs = sweep_configs(n, k, fmt, quick)
    configs += [default] if default not in configs else []
    swept = sorted((p.skinny_us(x, r, c), _label(c), c) for c in configs)
    best = swept[0][2]
    late = dataclasses.replace(best, preload=False)
    no_preload_us = p.skinny_us(x, r, late)
    weight_mb = n * k * (2 if fmt == "bf16" else 1) / 1e6
    rows = []
    for m in ROWS:
        x, r = p.inputs(m)
        row: Row = {"gemm": name, "N": n, "K": k, "M": m, "MB": round(weight_mb, 1)}
        row["cublas_us"] = p.cublas_us(x)
        if fmt != "bf16" or m == 1:
            row["gemv_us"] = p.gemv_us(x, r)
        if fmt != "bf16":
            row["fp8_gemm_us"] = p.fp8_gemm_us(x)
        row["skinny_us"] = p.skinny_us(x, r, best)
        row["default_us"] = p.skinny_us(x, r, default)
        row["skinny_TBps"] = weight_mb / row["skinny_us"]
        row["cublas_TBps"] = n * k * 2 / 1e6 / row["cublas_us"]
        row["rel_err"] = p.rel_err(x, r, best)
        row["best"] = _label(best)
        row["no_preload_us_at_5"] = no_preload_us
        row["config"] = best
        rows.append(row)
    print(f"{name}: sweep at M={SWEEP_ROWS}: " + ", ".join(f"{lab} {us:.1f}" for us, lab, _ in swept[:4]), flush=True)  # fmt: skip
    del p
    torch.cuda.empty_cache()
    return rows


def crossover(rows: list[Row], prefix: str, key: str, against: str) -> int:
    """The largest M up to which `key` beats `against` summed over a model's decoder-layer
    shapes (`prefix`, LM head left out) at every measured M from 2 (1 when none)."""
    best = 1
    for m in ROWS[1:]:
        layer = [r for r in rows if r["gemm"].startswith(prefix) and "lm_head" not in r["gemm"]]
        layer = [r for r in layer if r["M"] == m]
        if not layer or sum(r[key] for r in layer) >= sum(r[against] for r in layer):
            break
        best = m
    return best


def summarize(rows: list[Row], fmt: str) -> Row:
    """Print the switches this sweep suggests and return them."""
    out: Row = {}
    for prefix in ("8b", "0.6b", "135m"):
        if not any(r["gemm"].startswith(prefix) for r in rows):
            continue
        if fmt == "bf16":
            out[f"{prefix}_skinny_beats_cublas_up_to"] = crossover(rows, prefix, "skinny_us", "cublas_us")  # fmt: skip
            continue
        m1 = [r for r in rows if r["gemm"].startswith(prefix) and r["M"] == 1]
        m1 = [r for r in m1 if "lm_head" not in r["gemm"]]
        out[f"{prefix}_skinny_beats_fp8_gemv_at_1"] = sum(r["skinny_us"] for r in m1) < sum(r["gemv_us"] for r in m1)  # fmt: skip
        for r in rows:
            r["weight_only_us"] = min(r["skinny_us"], r["gemv_us"])
        out[f"{prefix}_skinny_beats_fp8_gemv_up_to"] = crossover(rows, prefix, "skinny_us", "gemv_us")  # fmt: skip
        out[f"{prefix}_skinny_beats_fp8_gemm_up_to"] = crossover(rows, prefix, "skinny_us", "fp8_gemm_us")  # fmt: skip
        out[f"{prefix}_weight_only_beats_fp8_gemm_up_to"] = crossover(rows, prefix, "weight_only_us", "fp8_gemm_us")  # fmt: skip
    print("\nswitches (decoder-layer shapes summed; LM heads left out):")
    for key, value in out.items():
        print(f"  {key}: {value}")
    return out


def print_tuned(rows: list[Row], fmt: str) -> None:
    print(f"\n# {fmt} weights: paste into TUNED in minisgl/kernels/gemv/skinny.py")
    seen = set()
    for r in rows:
        key = (r["N"], r["K"], "act" in r["gemm"], fmt)
        if key in seen:
            continue
        seen.add(key)
        c = r["config"]
        print(f"    {key}: SkinnyConfig({c.block_n}, {c.block_k}, {c.num_warps}, {c.num_stages}, {c.split_k}),  # {r['gemm']}")  # fmt: skip


def run(fmt: str, quick: bool, only: Sequence[str] = ()) -> Row:
    """The sweep for one weight format (bf16, row, block); prints tables, returns the figures."""
    if not torch.cuda.is_available():
        raise SystemExit("the skinny sweep needs a CUDA GPU; none is visible here.")
    torch.manual_seed(0)
    rows: list[Row] = []
    for name, (n, k, kind) in SHAPES.items():
        if (only and not any(name.startswith(o) for o in only)) or (fmt != "bf16" and "lm_head" in name):  # fmt: skip
            continue  # (an FP8 model keeps its LM head in 16 bits)
        rows += probe_shape(name, n, k, kind, fmt, quick)
    columns = ["gemm", "M", "MB", "cublas_us", "gemv_us", "fp8_gemm_us", "skinny_us",
               "default_us", "no_preload_us_at_5", "skinny_TBps", "cublas_TBps", "rel_err", "best"]  # fmt: skip
    print_table(f"skinny GEMM, {fmt} weights (us per call; TB/s of weight bytes)", rows, columns)
    switches = summarize(rows, fmt)
    print_tuned(rows, fmt)
    for r in rows:
        r["config"] = _label(r["config"])
    return {"format": fmt, "rows": rows, "switches": switches}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fp8", action="store_true", help="e4m3 weights, a scale per row")
    p.add_argument("--fp8-block", action="store_true", help="e4m3 weights, 128 x 128 blocks")
    p.add_argument("--quick", action="store_true", help="fewer configs (about two minutes)")
    p.add_argument(
        "--only", default="", help="comma-separated shape name prefixes (8b, 0.6b, 135m)"
    )


def fmt_of(args: argparse.Namespace) -> str:
    return "block" if args.fp8_block else "row" if args.fp8 else "bf16"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(parser)
    args = parser.parse_args(argv)
    only = [o for o in args.only.split(",") if o]
    emit_json(run(fmt_of(args), args.quick, only))


if __name__ == "__main__":
    main()
