"""The GEMV tuner: the fused Triton GEMV (`minisgl.kernels.gemv.gemv`) against cuBLAS at batch-1
decode shapes, and the tile configs for `minisgl.kernels.gemv.gemv.TUNED`.

1. Per shape, cuBLAS `F.linear` and a sweep of GEMV configs, each timed as a CUDA graph of
   back-to-back calls over weight copies of >= 600 MB (L2 never holds them), with the fused
   prologue / epilogue the model would use (norm before qkv / gate_up, residual after o_proj /
   down, gate/up combined): microseconds, TB/s, the best configs, and the best config with the
   first weight tile loaded after the PDL wait instead of before it.
2. One Llama-3-8B decoder layer's linear work at batch 1, as the model runs it today (RMSNorm
   kernel, cuBLAS qkv, two small kernels standing in for RoPE and attention, cuBLAS o_proj,
   add + RMSNorm kernel, cuBLAS gate_up, SiLU-and-mul, cuBLAS down) against the fused GEMVs
   (qkv with the norm, the same two small kernels, o_proj + residual, gate_up with the norm and
   SiLU, down + residual; or SiLU in down's prologue): microseconds per layer over 8 layers'
   worth of distinct weights, with the default configs and again with the best of the sweep.

Run on a GPU host: `python -m minisgl.benchmark.gemv [--quick]`; it prints a `TUNED` table to
paste into `minisgl/kernels/gemv/gemv.py`. `--fp8`: the same sweep (part 1) with e4m3 weights and a
scale per row, the FP8 linear layers' weight-only path (bytes at one per weight; cuBLAS stays
the bf16 reference), printing `TUNED_FP8`. Its sweep adds the one-row FP8 variants of the
vec layout (`GemvConfig.layout` "vec": 16-byte e4m3 loads, int32 words, PTX or converting
widening, per-column sums; the gemv module's docstring says why); every
variant's result is checked against fp32 torch first (a wrong one is listed under "wrong" and
not ranked), and each shape's line gives the best of each variant family
(`best_per_family`). One H200 call (under 2 minutes):
`python -m minisgl.benchmark.gemv --fp8 --quick --only 8b` (`--only`: shape name prefixes).

`--skinny`: the skinny tensor-core GEMM's sweep for 1..16 rows of x instead
(`minisgl.benchmark.skinny`, whose docstring says what it measures), with `--fp8` (a scale per
row) or `--fp8-block` (128 x 128 blocks) for e4m3 weights:
`python -m minisgl.benchmark.gemv --skinny --quick [--fp8 | --fp8-block]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from minisgl.benchmark.common import emit_json, time_graph
from minisgl.kernels.fused import rms_norm, silu_and_mul
from minisgl.kernels.gemv.gemv import TUNED, TUNED_FP8, GemvConfig, default_config, gemv

# name -> (N, K, how the model calls it)
SHAPES = {
    "8b qkv": (6144, 4096, "norm"),
    "8b o_proj": (4096, 4096, "residual"),
    "8b gate_up": (28672, 4096, "norm"),
    "8b down act": (4096, 14336, "act_residual"),
    "8b lm_head": (128256, 4096, "norm"),
    "30b-a3b qkv": (5120, 2048, "norm"),
    "30b-a3b o_proj": (2048, 4096, "residual"),
}
DEV = torch.device("cuda")
DT = torch.bfloat16
Configs = dict[tuple[int, int, bool], GemvConfig]  # (N, K, act) -> config, as `TUNED`


def _configs(quick: bool, fp8: bool = False) -> list[GemvConfig]:
    """Tiles to sweep. FP8 weights are one byte: the same bytes in flight per program take
    tiles twice as large (up to 256 elements per thread), so their sweep goes further, and
    adds the vec layout at one row (`_fp8_variants`)."""
    if quick:
        tiles = [GemvConfig(bn, bk, w) for bn, bk, w in [(16, 512, 4), (8, 512, 4), (32, 256, 8)]]
        return tiles + _fp8_variants(quick) if fp8 else tiles
    most = 256 if fp8 else 128
    out = []
    block_ks = (256, 512, 1024, 2048) if fp8 else (256, 512, 1024)
    for bn, bk, w in itertools.product((4, 8, 16, 32, 64), block_ks, (4, 8)):
        if bn * bk // (32 * w) > most or bn * bk // (32 * w) < 8:  # elements per thread
            continue
        if bn == 64 and not fp8:
            continue
        out.append(GemvConfig(bn, bk, w))
    return out + _fp8_variants(quick) if fp8 else out


def _fp8_variants(quick: bool) -> list[GemvConfig]:
    """One-row FP8 variants in the vec layout (`GemvConfig.layout` "vec"): 16
    e4m3 columns a thread per step (16-byte loads), BLOCK_K = 16 x 32 x warps; the bytes
    loaded as int32 words or as e4m3, widened by conversion or inline PTX; partial sums per
    VEC or per column; x ahead or not."""

    def vec(bn: int, warps: int = 4, **kw: Any) -> GemvConfig:
        return GemvConfig(bn, 16 * 32 * warps, warps, layout="vec", vec=16, **kw)

    if quick:
        out = [vec(bn, words=True, widen="ptx", keep_vec=kv) for bn in (4, 8) for kv in (False, True)]  # fmt: skip
        out += [vec(16, words=True, widen="ptx")]
        out += [vec(8, words=True, widen="cvt"), vec(8, widen="cvt")]
        out += [vec(8, words=True, widen="ptx", keep_vec=True, x_ahead=False)]
        out += [vec(8, 8, words=True, widen="ptx", keep_vec=True), vec(4, 8, words=True, widen="ptx")]  # fmt: skip
        out += _persist_variants()
        return out
    return _persist_variants() + [
        vec(bn, warps, words=words, widen=widen, keep_vec=kv, x_ahead=ahead)
        for bn, warps, words, widen, kv, ahead in itertools.product(
            (2, 4, 8, 16),
            (4, 8),
            (False, True),
            ("cvt", "ptx"),
            (False, True),
            (True, False),
        )  # fmt: skip
        if (words or widen != "ptx")
        and bn * warps <= 64  # (16 rows x 8 warps: 255 registers and more)
        and (ahead or (words and widen == "ptx"))
    ]


def _persist_variants() -> list[GemvConfig]:
    """The persistent grid (`GemvConfig.persist`: programs per SM) at the programs an SM holds
    at each tile's registers (sm_90 build, `tests/kernels/test_gemv.py`: 8 rows 128-140
    registers, 3-4 programs of 128 threads; 4 rows 64-71, 7-8), and a little under."""

    def vec(bn: int, persist: int, **kw: Any) -> GemvConfig:
        return GemvConfig(bn, 2048, 4, layout="vec", vec=16, words=True, widen="ptx",
                          persist=persist, **kw)  # fmt: skip

    out = [vec(8, p) for p in (2, 3, 4)] + [vec(8, 3, keep_vec=True)]
    return out + [vec(4, p) for p in (4, 6, 7, 8)] + [vec(4, 6, x_ahead=False)]


def config_src(c: GemvConfig) -> str:
    """`c` as Python source for `TUNED_FP8`: the tile, then the fields that differ from the
    defaults."""
    default = GemvConfig(c.block_n, c.block_k, c.num_warps)
    extra = [
        f"{f.name}={_src(getattr(c, f.name))}"
        for f in dataclasses.fields(c)
        if f.name not in ("block_n", "block_k", "num_warps")
        and getattr(c, f.name) != getattr(default, f.name)
    ]
    return f"GemvConfig({', '.join([str(c.block_n), str(c.block_k), str(c.num_warps), *extra])})"


def _src(value: object) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def family(c: GemvConfig) -> str:
    """The variant's kind, without its tile: what the sweep reports the best of."""
    if c.layout == "tile":
        return "tile"
    parts = ["vec", f"v{c.vec}", "words" if c.words else "e4m3", c.widen]
    parts += ["keep_vec"] if c.keep_vec else []
    parts += [] if c.x_ahead else ["x_at"]
    parts += [f"persist {c.persist}"] if c.persist else []
    return " ".join(parts)


# A weight as the GEMV takes it: bf16 (scale None) or e4m3 with fp32 scales per row.
Weight = tuple[torch.Tensor, torch.Tensor | None]


def _call(
    kind: str,
    x: torch.Tensor,
    w: Weight,
    r: torch.Tensor,
    g: torch.Tensor,
    cfg: GemvConfig | None,
) -> torch.Tensor:
    weight, scale = w
    if kind == "norm":
        return gemv(x, weight, norm_weight=g, config=cfg, weight_scale=scale)
    if kind == "act_residual":
        return gemv(x, weight, residual=r, act=True, config=cfg, weight_scale=scale)
    return gemv(x, weight, residual=r, config=cfg, weight_scale=scale)


def label(c: GemvConfig) -> str:
    """A config in a few words: its tile and what differs from the defaults."""
    return f"{c.block_n}x{c.block_k} w{c.num_warps}" + (
        f" {family(c)}" if c.layout != "tile" else ""
    )


def _weights(n: int, k: int, sets: int, fp8: bool) -> list[Weight]:
    from minisgl.kernels.fp8 import quantize_rows

    dense = (torch.randn(n, k, device=DEV, dtype=DT) * k**-0.5 for _ in range(sets))
    return [quantize_rows(w) if fp8 else (w, None) for w in dense]


def _values(w: Weight) -> torch.Tensor:
    """The bf16 values a weight stands for."""
    weight, scale = w
    return weight if scale is None else (weight.float() * scale[:, None]).to(DT)


def probe_shape(
    name: str, n: int, k: int, kind: str, configs: list[GemvConfig], fp8: bool = False
) -> dict[str, Any]:
    elem = 1 if fp8 else 2
    sets = max(2, -(-(600 << 20) // (n * k * elem)))
    ws = _weights(n, k, sets, fp8)
    x = torch.randn(1, 2 * k if kind == "act_residual" else k, device=DEV, dtype=DT)
    r = torch.randn(1, n, device=DEV, dtype=DT)
    g = torch.rand(k, device=DEV, dtype=DT) + 0.5
    mb = n * k * elem / 1e6
    # Correctness of the fused call at this shape against fp32 torch.
    xf = x.float()
    if kind == "act_residual":
        xf = F.silu(xf[:, :k]) * xf[:, k:]
    if kind.startswith("norm"):
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * g.float()
    want = xf @ _values(ws[0]).float().t()
    if kind.endswith("residual"):
        want = want + r.float()
    got = _call(kind, x, ws[0], r, g, None).float()
    err = ((got - want).abs().max() / want.abs().max()).item()
    row: dict[str, Any] = {
        "gemm": name,
        "N": n,
        "K": k,
        "kind": kind,
        "MB": round(mb, 1),
        "rel_err": err,
    }
    xk = x[:, :k].contiguous()  # cuBLAS gets the plain product (bf16) at this shape
    dense = [_values(w) for w in ws[: max(2, sets * elem // 2)]]
    row["cublas_us"] = time_graph(lambda i: F.linear(xk, dense[i]), len(dense)) * 1e6

    def timed_us(cfg: GemvConfig | None) -> float:
        return time_graph(lambda i: _call(kind, x, ws[i], r, g, cfg), sets) * 1e6

    failed: dict[GemvConfig, str] = {}

    def rel_err(cfg: GemvConfig) -> float:
        try:
            out = _call(kind, x, ws[0], r, g, cfg).float()
        except Exception as e:  # (a variant this triton cannot compile: reported, not fatal)
            failed[cfg] = f"{type(e).__name__}: {str(e)[:200]}"
            return math.nan
        return ((out - want).abs().max() / want.abs().max()).item()

    # Every variant's result is checked first: a wrong one (> 2e-2, bf16 output rounding is
    # ~4e-3) or one that fails to compile is reported and left out of the ranking.
    errs = {c: rel_err(c) for c in configs}
    wrong = [f"{label(c)}: {failed.get(c) or f'{e:.3g}'}" for c, e in errs.items() if not e <= 2e-2]
    timed = sorted(((timed_us(c), c) for c in configs if errs[c] <= 2e-2), key=lambda t: t[0])
    best_us, best = timed[0]
    row["gemv_us"] = best_us
    row["best"] = label(best)
    row["no_preload_us"] = timed_us(dataclasses.replace(best, preload=False))
    row["default_us"] = timed_us(None)
    row["top5"] = [f"{label(c)}: {u:.2f}" for u, c in timed[:5]]
    families: dict[str, tuple[float, GemvConfig]] = {}
    for u, c in timed:
        families.setdefault(family(c), (u, c))
    row["best_per_family"] = {f: f"{u:.2f} us {mb / u:.2f} TB/s ({label(c)})" for f, (u, c) in families.items()}  # fmt: skip
    row["wrong"] = wrong
    row["max_rel_err"] = max(e for e in errs.values() if e <= 2e-2)
    row["config"] = best
    row["cublas_TBps"] = n * k * 2 / 1e6 / row["cublas_us"]
    row["gemv_TBps"] = mb / best_us
    return row


def probe_layer(tuned: Configs, layers: int = 8) -> dict[str, Any]:
    """One Llama-3-8B layer's batch-1 linear work, cuBLAS + small kernels vs fused GEMVs (SiLU
    in the down projection's prologue, as the model runs them), with the configs of `tuned`
    where it has the shape and the defaults elsewhere."""
    h, qkv, inter = 4096, 6144, 14336

    def mk(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, device=DEV, dtype=DT) * k**-0.5

    def cfg(n: int, k: int, act: bool = False) -> GemvConfig:
        return tuned.get((n, k, act)) or default_config(n, k, act)

    ws = [(mk(qkv, h), mk(h, h), mk(2 * inter, h), mk(h, inter)) for _ in range(layers)]
    g1 = torch.rand(h, device=DEV, dtype=DT) + 0.5
    g2 = torch.rand(h, device=DEV, dtype=DT) + 0.5
    x0 = torch.randn(1, h, device=DEV, dtype=DT)
    small = torch.randn(1, 32, 128, device=DEV, dtype=DT)
    gs = torch.ones(128, device=DEV, dtype=DT)

    def cublas_layer(i: int) -> torch.Tensor:
        wq, wo, wgu, wd = ws[i]
        a, res = rms_norm(x0, g1, 1e-6, x0)
        F.linear(a, wq)
        att = rms_norm(rms_norm(small, gs, 1e-6)[0], gs, 1e-6)[0].view(1, -1)  # RoPE, attention
        o = F.linear(att, wo)
        m, res = rms_norm(o, g2, 1e-6, res)
        return F.linear(silu_and_mul(F.linear(m, wgu)), wd)

    def fused_act_layer(i: int) -> torch.Tensor:
        wq, wo, wgu, wd = ws[i]
        gemv(x0, wq, norm_weight=g1, config=cfg(qkv, h))
        att = rms_norm(rms_norm(small, gs, 1e-6)[0], gs, 1e-6)[0].view(1, -1)
        r = gemv(att, wo, residual=x0, config=cfg(h, h))
        up = gemv(r, wgu, norm_weight=g2, config=cfg(2 * inter, h))
        return gemv(up, wd, residual=r, act=True, config=cfg(h, inter, True))

    return {
        "layer": "8b decoder layer, bs 1",
        "cublas_us": time_graph(cublas_layer, layers) * 1e6,
        "fused_act_us": time_graph(fused_act_layer, layers) * 1e6,
        "bytes_floor_us_at_4.3TBps": sum(w.numel() * 2 for w in ws[0]) / 4.3e6,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 configs per shape")
    parser.add_argument("--fp8", action="store_true", help="e4m3 weights, a scale per row")
    parser.add_argument(
        "--skinny",
        action="store_true",
        help="the skinny GEMM's sweep at 1..16 rows (minisgl.benchmark.skinny)",
    )
    parser.add_argument(
        "--fp8-block",
        action="store_true",
        help="--skinny: e4m3 weights with 128 x 128 block scales",
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated shape name prefixes (8b, 30b; --skinny: 8b, 0.6b, 135m)",
    )
    args = parser.parse_args(argv)
    if args.skinny:
        from minisgl.benchmark import skinny

        only = [o for o in args.only.split(",") if o]
        emit_json(skinny.run(skinny.fmt_of(args), args.quick, only))
        return
    if not torch.cuda.is_available():
        raise SystemExit("minisgl.benchmark.gemv needs a CUDA GPU; none is visible here.")
    torch.manual_seed(0)
    if not args.fp8:
        print("default configs:", json.dumps(probe_layer(TUNED)), flush=True)
    configs = _configs(args.quick, args.fp8)
    rows, best = [], dict(TUNED_FP8 if args.fp8 else TUNED)
    only = [o for o in args.only.split(",") if o]
    for name, (n, k, kind) in SHAPES.items():
        if only and not name.startswith(tuple(only)):
            continue
        row = probe_shape(name, n, k, kind, configs, args.fp8)
        rows.append(row)
        best[(n, k, kind == "act_residual")] = row.pop("config")
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
        torch.cuda.empty_cache()
    if not args.fp8:
        print("best configs:", json.dumps(probe_layer(best)), flush=True)
    print("TUNED_FP8 = {" if args.fp8 else "TUNED = {")
    for key, c in best.items():
        print(f"    {key}: {config_src(c)},")
    print("}")
    print(f"\n{'gemm':>16} {'MB':>7} {'cublas_us':>9} {'TB/s':>5} {'gemv_us':>8} {'TB/s':>5}"
          f" {'no_pre':>7} {'default':>7}  best")  # fmt: skip
    for r in rows:
        print(f"{r['gemm']:>16} {r['MB']:>7.1f} {r['cublas_us']:>9.2f} {r['cublas_TBps']:>5.2f}"
              f" {r['gemv_us']:>8.2f} {r['gemv_TBps']:>5.2f} {r['no_preload_us']:>7.2f}"
              f" {r['default_us']:>7.2f}  {r['best']}")  # fmt: skip


if __name__ == "__main__":
    main()
