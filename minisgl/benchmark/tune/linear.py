"""Tuners of the linear-layer kernels on one CUDA GPU: the one-row GEMV's tiles (`TUNED`,
`TUNED_FP8` of `minisgl/kernels/gemv/gemv.py`), the skinny GEMM's (`TUNED` of
`minisgl/kernels/gemv/skinny.py`) and the row count up to which the FP8 weight-only GEMV beats
the FP8 tensor-core GEMM (`FP8_GEMV_MAX_ROWS` of `minisgl/config/quant.py`).

Every shape is called with the fusions the model uses there (the norm before qkv, gate/up and
the LM head, the residual after o_proj and down, SiLU in down's prologue) and timed as CUDA
graphs of back-to-back calls over weight copies of >= 600 MB, so L2 never holds them; every
variant's result is checked against fp32 torch first (a wrong one, or one that does not
compile, is listed and not ranked).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from minisgl.benchmark.common import Row, print_table, time_graph
from minisgl.benchmark.tune import checked, search

DEV = torch.device("cuda")
DT = torch.bfloat16
ROTATION_BYTES = 600 << 20
# name -> (N, K, how the model calls it); SmolLM2-135M's speculative verify steps (5-9 rows) are
# the skinny GEMM's main use
# fmt: off
SHAPES = {
    "8b qkv": (6144, 4096, "norm"), "8b o_proj": (4096, 4096, "residual"),
    "8b gate_up": (28672, 4096, "norm"), "8b down act": (4096, 14336, "act_residual"),
    "8b lm_head": (128256, 4096, "norm"),
    "30b-a3b qkv": (5120, 2048, "norm"), "30b-a3b o_proj": (2048, 4096, "residual"),
    "0.6b qkv": (4096, 1024, "norm"), "0.6b o_proj": (1024, 2048, "residual"),
    "0.6b gate_up": (6144, 1024, "norm"), "0.6b down act": (1024, 3072, "act_residual"),
    "0.6b lm_head": (151936, 1024, "norm"),
    "135m qkv": (960, 576, "norm"), "135m o_proj": (576, 576, "residual"),
    "135m gate_up": (3072, 576, "norm"), "135m down act": (576, 1536, "act_residual"),
    "135m lm_head": (49152, 576, "norm"),
}
# fmt: on
GEMV_SHAPES = ("8b", "30b")
SKINNY_SHAPES = ("8b", "0.6b", "135m")
SKINNY_ROWS = (1, 2, 4, 5, 8, 9, 16)
SKINNY_SWEEP_ROWS = 5  # a verify step of 4 drafts at batch 1
FP8_GEMM_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256)

Weight = tuple[torch.Tensor, torch.Tensor | None]  # bf16 (scale None), or e4m3 and fp32 scales


class Probe:
    """One shape's rotating weight copies and inputs: `call` runs a kernel with the model's
    fusions, `check` gives its error against fp32 torch, `cublas_us` times bf16 `F.linear`."""

    def __init__(self, n: int, k: int, kind: str, fp8: bool) -> None:
        from minisgl.kernels.fp8 import quantize_rows

        self.n, self.k, self.kind, self.fp8 = n, k, kind, fp8
        sets = max(2, math.ceil(ROTATION_BYTES / (n * k * (1 if fp8 else 2))))
        dense = (torch.randn(n, k, device=DEV, dtype=DT) * k**-0.5 for _ in range(sets))
        self.ws: list[Weight] = [quantize_rows(w) if fp8 else (w, None) for w in dense]
        self.g = torch.rand(k, device=DEV, dtype=DT) + 0.5

    def inputs(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        cols = 2 * self.k if self.kind == "act_residual" else self.k
        return torch.randn(m, cols, device=DEV, dtype=DT), torch.randn(
            m, self.n, device=DEV, dtype=DT
        )

    def call(self, fn: Any, x: torch.Tensor, r: torch.Tensor, i: int, **kw: Any) -> torch.Tensor:
        weight, scale = self.ws[i]
        if self.kind == "norm":
            kw["norm_weight"] = self.g
        elif self.kind.endswith("residual"):
            kw |= {"residual": r, "act": self.kind == "act_residual"}
        return fn(x, weight, weight_scale=scale, **kw)  # type: ignore[no-any-return]

    def us(self, fn: Any, x: torch.Tensor, r: torch.Tensor, **kw: Any) -> float:
        return 1e6 * time_graph(lambda i: self.call(fn, x, r, i, **kw), len(self.ws))

    def check(self, fn: Any, x: torch.Tensor, r: torch.Tensor, **kw: Any) -> float:
        """Relative error against fp32 torch."""
        weight, scale = self.ws[0]
        w = weight.float() if scale is None else weight.float() * scale[:, None]
        xf = x.float()
        if self.kind == "act_residual":
            xf = F.silu(xf[:, : self.k]) * xf[:, self.k :]
        if self.kind == "norm":
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * self.g.float()
        want = xf @ w.to(DT).float().t() + (r.float() if self.kind.endswith("residual") else 0)
        got = self.call(fn, x, r, 0, **kw).float()  # a variant that does not build raises
        return ((got - want).abs().max() / want.abs().max()).item()

    def trial(self, fn: Any, x: torch.Tensor, r: torch.Tensor) -> Callable[[Any], Row]:
        """`search`'s run of `fn` by config: checked against fp32 torch (a wrong one raises),
        then timed."""

        def run(c: Any) -> Row:
            err = checked(self.check(fn, x, r, config=c))
            return {"config": c, "rel_err": err, "us": self.us(fn, x, r, config=c)}

        return run

    def cublas_us(self, x: torch.Tensor) -> float:
        xk = x[:, : self.k].contiguous()
        dense = [w if s is None else (w.float() * s[:, None]).to(DT) for w, s in self.ws]
        dense = dense[: max(2, len(dense) // (2 if self.fp8 else 1))]  # the same bytes as e4m3
        return 1e6 * time_graph(lambda i: F.linear(xk, dense[i]), len(dense))


def _shapes(prefixes: tuple[str, ...], only: list[str]) -> list[tuple[str, tuple[int, int, str]]]:
    return [
        (name, s)
        for name, s in SHAPES.items()
        if name.startswith(prefixes) and (not only or name.startswith(tuple(only)))
    ]


# ---- the one-row GEMV ----------------------------------------------------------------------------


def gemv_configs(quick: bool, fp8: bool) -> list[Any]:
    """Tiles to sweep; FP8 weights (one byte) take tiles twice as large for the same bytes in
    flight, and add the vec layout's one-row variants (16 e4m3 columns a thread per step, kept
    as int32 words widened by inline PTX, the other widenings having measured slower; sums per
    column or per 16, x a step ahead or not)."""
    from minisgl.kernels.gemv.gemv import GemvConfig

    if quick:
        tiles = [GemvConfig(bn, bk, w) for bn, bk, w in [(16, 512, 4), (8, 512, 4), (32, 256, 8)]]
    else:
        tiles = [
            GemvConfig(bn, bk, w)
            for bn, bk, w in itertools.product((4, 8, 16, 32, 64), (256, 512, 1024, 2048), (4, 8))
            if 8 <= bn * bk // (32 * w) <= (256 if fp8 else 128)
            and (fp8 or (bn < 64 and bk < 2048))
        ]
    vec = [
        GemvConfig(bn, 512 * w, w, layout="vec", vec=16, words=True, widen="ptx", keep_vec=keep,
                   x_ahead=ahead)
        for bn, w, keep, ahead in itertools.product((4, 8) if quick else (2, 4, 8, 16),
                                                    (4,) if quick else (4, 8), (False, True),
                                                    (True, False))
        if bn * w <= 64
    ]  # fmt: skip
    return tiles + vec if fp8 else tiles


def label(c: Any) -> str:
    """A config as Python source: the tile, then the fields that differ from the defaults."""
    default = type(c)(c.block_n, c.block_k, c.num_warps)
    extra = [
        f"{f.name}={getattr(c, f.name)!r}"
        for f in dataclasses.fields(c)
        if f.name not in ("block_n", "block_k", "num_warps")
        and getattr(c, f.name) != getattr(default, f.name)
    ]
    fields = ", ".join([str(c.block_n), str(c.block_k), str(c.num_warps), *extra])
    return f"{type(c).__name__}({fields})"


def tune_gemv(quick: bool, fp8: bool, only: list[str]) -> list[Row]:
    """Per shape: cuBLAS, every config (checked, then timed), the default; prints the table to
    paste."""
    from minisgl.kernels.gemv.gemv import TUNED, TUNED_FP8, gemv

    rows, best = [], dict(TUNED_FP8 if fp8 else TUNED)
    for name, (n, k, kind) in _shapes(GEMV_SHAPES, only):
        p = Probe(n, k, kind, fp8)
        x, r = p.inputs(1)
        trials = search(gemv_configs(quick, fp8), p.trial(gemv, x, r), "us")
        timed = [t for t in trials if "error" not in t]
        us, cfg = timed[0]["us"], timed[0]["config"]
        best[(n, k, kind == "act_residual")] = cfg
        mb = n * k * (1 if fp8 else 2) / 1e6
        rows.append({"gemm": name, "MB": mb, "cublas_us": p.cublas_us(x),
                     "gemv_us": us, "TB/s": mb / us,
                     "default_us": p.us(gemv, x, r), "best": label(cfg),
                     "top5": [f"{label(t['config'])}: {t['us']:.2f}" for t in timed[:5]],
                     "wrong": [label(t["config"]) for t in trials if "error" in t]})  # fmt: skip
        torch.cuda.empty_cache()
    print_table(
        f"one-row GEMV, {'e4m3' if fp8 else 'bf16'} weights (us per call)",
        rows,
        ["gemm", "MB", "cublas_us", "gemv_us", "TB/s", "default_us", "best"],
    )
    print(f"\n{'TUNED_FP8' if fp8 else 'TUNED'} = {{")
    for key, c in best.items():
        print(f"    {key}: {label(c)},")
    print("}")
    return rows


# ---- the skinny GEMM -----------------------------------------------------------------------------


def skinny_configs(n: int, k: int, quick: bool) -> list[Any]:
    """Tiles, each unsplit and split so that the SMs get two programs each (at least 4 K steps
    a split)."""
    from minisgl.kernels.gemv.skinny import SkinnyConfig

    tiles = [(32, 128, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3)]
    tiles += [] if quick else [(128, 128, 8, 4), (16, 256, 4, 4), (32, 128, 4, 6)]
    out = []
    for bn, bk, warps, stages in tiles:
        split = max(1, min(8, -(-2 * 132 // -(-n // bn)), k // (4 * bk)))
        out += [SkinnyConfig(bn, bk, warps, stages, s) for s in sorted({1, split})]
    return out


def tune_skinny(quick: bool, only: list[str]) -> list[Row]:
    """bf16 weights (e4m3 ones ran at 1.1-1.6 TB/s on the H200, behind the FP8 GEMV: not used):
    a sweep at SKINNY_SWEEP_ROWS rows, then the best and the default against cuBLAS (and the
    GEMV at one row) at every row count; the row count up to which the skinny GEMM beats cuBLAS
    over a decoder layer's shapes at every count from 2 (`resolve_skinny_max_rows`), and the
    table to paste."""
    from minisgl.kernels.gemv.gemv import gemv
    from minisgl.kernels.gemv.skinny import default_config, skinny

    rows: list[Row] = []
    for name, (n, k, kind) in _shapes(SKINNY_SHAPES, only):
        p = Probe(n, k, kind, fp8=False)
        x, r = p.inputs(SKINNY_SWEEP_ROWS)
        default = default_config(n, k, kind == "act_residual")
        configs = list(dict.fromkeys([*skinny_configs(n, k, quick), default]))
        best = search(configs, p.trial(skinny, x, r), "us")[0]["config"]
        for m in SKINNY_ROWS:
            x, r = p.inputs(m)
            rows.append({"gemm": name, "N": n, "K": k, "M": m, "cublas_us": p.cublas_us(x),
                         "gemv_us": p.us(gemv, x, r) if m == 1 else math.nan,
                         "skinny_us": p.us(skinny, x, r, config=best),
                         "default_us": p.us(skinny, x, r, config=default),
                         "rel_err": p.check(skinny, x, r, config=best), "best": best})  # fmt: skip
        torch.cuda.empty_cache()
    print_table(
        "skinny GEMM, bf16 weights (us per call)",
        rows,
        ["gemm", "M", "cublas_us", "gemv_us", "skinny_us", "default_us", "rel_err"],
    )
    for prefix in SKINNY_SHAPES:
        layer = [w for w in rows if w["gemm"].startswith(prefix) and "lm_head" not in w["gemm"]]
        up_to = _crossover(layer, "skinny_us", "cublas_us")
        print(f"{prefix}: the skinny GEMM beats cuBLAS up to M = {up_to}")
    print("\n# paste into TUNED in minisgl/kernels/gemv/skinny.py")
    for row in rows[:: len(SKINNY_ROWS)]:
        c = row["best"]
        tile = f"{c.block_n}, {c.block_k}, {c.num_warps}, {c.num_stages}, {c.split_k}"
        key = f"({row['N']}, {row['K']}, {'act' in row['gemm']}, 'bf16')"
        print(f"    {key}: SkinnyConfig({tile}),  # {row['gemm']}")
    return [{**row, "best": str(row["best"])} for row in rows]


def _crossover(rows: list[Row], key: str, against: str, key_m: str = "M") -> int:
    """The largest row count up to which `key` beats `against` summed over `rows`' shapes at
    every measured count from 2 (1 when none)."""
    best = 1
    for m in sorted({r[key_m] for r in rows} - {1}):
        at = [r for r in rows if r[key_m] == m]
        if sum(r[key] for r in at) >= sum(r[against] for r in at):
            break
        best = m
    return best


# ---- FP8 weights: the weight-only GEMV against the tensor-core GEMM ------------------------------


def tune_fp8_gemm() -> list[Row]:
    """us per call of bf16 `F.linear`, the FP8 weight-only GEMV and the FP8 tensor-core GEMM
    (`fp8_linear`: per-token activation quantization + the scaled GEMM) at Llama-3-8B's
    projections and FP8_GEMM_ROWS rows; the switch is the largest row count up to which the
    GEMV wins for the four projections summed, every time."""
    rows: list[Row] = []
    for name, (n, k, _) in _shapes(("8b",), []):
        if "lm_head" not in name:
            p = Probe(n, k, "plain", fp8=True)
            rows += [_fp8_linear_row(p, name, m) for m in FP8_GEMM_ROWS]
            torch.cuda.empty_cache()
    columns = ["gemm", "m", "bf16_us", "fp8_gemv_us", "fp8_gemm_us"]
    print_table("FP8 linear: weight-only GEMV vs tensor-core GEMM (us per call)", rows, columns)
    switch = _crossover(rows, "fp8_gemv_us", "fp8_gemm_us", "m")
    print(f"\nFP8_GEMV_MAX_ROWS = {switch}  # minisgl/config/quant.py: the GEMV wins up to here")
    return rows


def _fp8_linear_row(p: Probe, name: str, m: int) -> Row:
    from minisgl.kernels.fp8.gemm import fp8_linear
    from minisgl.kernels.gemv.gemv import gemv

    x = torch.randn(m, p.k, device=DEV, dtype=DT)
    ws = p.ws
    gemv_s = time_graph(lambda i: gemv(x, ws[i][0], weight_scale=ws[i][1]), len(ws))
    gemm_s = time_graph(lambda i: fp8_linear(x, *ws[i]), len(ws))  # type: ignore[arg-type]
    return {"gemm": name, "m": m, "bf16_us": p.cublas_us(x), "fp8_gemv_us": gemv_s * 1e6,
            "fp8_gemm_us": gemm_s * 1e6}  # fmt: skip
