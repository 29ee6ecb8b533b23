"""Probe: the fused batch GEMM (`minisgl.kernels.rows_gemm`) against cuBLAS at W1's decode shapes
(Qwen3-0.6B: hidden 1024, q/k/v 2048 / 1024 / 1024, intermediate 3072).

1. One decoder layer's linear work for M rows, as the model runs it today (add + RMSNorm kernel,
   cuBLAS qkv, a small kernel standing in for RoPE and attention, cuBLAS o_proj, add + RMSNorm,
   cuBLAS gate_up, SiLU-and-mul, cuBLAS down) against the fused version (qkv with the norm,
   the same stand-in, o_proj + residual, gate_up with the norm, down with SiLU + residual):
   microseconds per layer over 28 layers of distinct weights (W1's model; 0.88 GB, L2 never
   holds them), default configs, then the best of the sweep.
2. Per projection and M, cuBLAS `F.linear` alone and a sweep of tile configs with the prologue
   / epilogue the model would use; the best configs.

Run on a GPU host: `PYTHONPATH=. python3 scripts/rows_gemm_probe.py [--quick] [--rows 64,214]`.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from minisgl.benchmark.common import time_graph
from minisgl.kernels.fused import rms_norm, silu_and_mul
from minisgl.kernels.rows_gemm import RowsGemmConfig, default_rows_config, rows_gemm

HIDDEN, QKV, INTER, ATTN = 1024, 4096, 3072, 2048
# name -> (N, K, how the model calls it)
SHAPES = {
    "qkv": (QKV, HIDDEN, "norm"),
    "o_proj": (HIDDEN, ATTN, "residual"),
    "gate_up": (2 * INTER, HIDDEN, "norm"),
    "down": (HIDDEN, INTER, "act_residual"),
}
LAYERS = 28
DEV = torch.device("cuda")
DT = torch.bfloat16
Configs = dict[str, RowsGemmConfig]


def _sweep(quick: bool) -> list[RowsGemmConfig]:
    if quick:
        base = [(64, 64, 64, 4, 3, 1), (32, 32, 128, 4, 3, 1), (64, 32, 64, 4, 3, 4)]
        return [RowsGemmConfig(*c) for c in base]
    out = []
    for bm, bn, bk, w, s, split in itertools.product(
        (32, 64, 128), (32, 64, 128), (64, 128), (4, 8), (3, 4), (1, 2, 4)
    ):
        if bm * bn > 128 * 64 or (w == 8 and bm * bn < 64 * 64):
            continue
        if split > 1 and (bn > 64 or s != 3):  # K slices: for the narrow tiles of a small N
            continue
        out.append(RowsGemmConfig(bm, bn, bk, w, s, split))
    return out


def _call(kind: str, x, w, r, g, cfg: RowsGemmConfig | None) -> torch.Tensor:
    if kind == "norm":
        return rows_gemm(x, w, norm_weight=g, config=cfg)
    if kind == "act_residual":
        return rows_gemm(x, w, residual=r, act=True, config=cfg)
    return rows_gemm(x, w, residual=r, config=cfg)


def _weights(layers: int) -> list[dict[str, torch.Tensor]]:
    return [
        {name: torch.randn(n, k, device=DEV, dtype=DT) * k**-0.5 for name, (n, k, _) in SHAPES.items()}
        for _ in range(layers)
    ]  # fmt: skip


def probe_layer(m: int, ws: list[dict[str, torch.Tensor]], configs: Configs) -> dict:
    x0 = torch.randn(m, HIDDEN, device=DEV, dtype=DT)
    g1 = torch.rand(HIDDEN, device=DEV, dtype=DT) + 0.5
    g2 = torch.rand(HIDDEN, device=DEV, dtype=DT) + 0.5
    small = torch.randn(m, ATTN // 128, 128, device=DEV, dtype=DT)  # q heads x head_dim
    gs = torch.ones(128, device=DEV, dtype=DT)

    def stand_in() -> torch.Tensor:  # RoPE and attention: two small kernels
        return rms_norm(rms_norm(small, gs, 1e-6)[0], gs, 1e-6)[0].view(m, -1)

    def cublas_layer(i: int) -> torch.Tensor:
        w = ws[i]
        a, res = rms_norm(x0, g1, 1e-6, x0)
        F.linear(a, w["qkv"])
        o = F.linear(stand_in(), w["o_proj"])
        h, res = rms_norm(o, g2, 1e-6, res)
        return F.linear(silu_and_mul(F.linear(h, w["gate_up"])), w["down"])

    def fused_layer(i: int) -> torch.Tensor:
        w = ws[i]
        rows_gemm(x0, w["qkv"], norm_weight=g1, config=configs.get("qkv"))
        r = rows_gemm(stand_in(), w["o_proj"], residual=x0, config=configs.get("o_proj"))
        h = rows_gemm(r, w["gate_up"], norm_weight=g2, config=configs.get("gate_up"))
        return rows_gemm(h, w["down"], residual=r, act=True, config=configs.get("down"))

    n = len(ws)
    return {
        "M": m,
        "cublas_layer_us": time_graph(cublas_layer, n) * 1e6,
        "fused_layer_us": time_graph(fused_layer, n) * 1e6,
    }


def probe_shape(m: int, name: str, ws: list[dict[str, torch.Tensor]], sweep: list) -> dict:
    n, k, kind = SHAPES[name]
    x = torch.randn(m, 2 * k if kind == "act_residual" else k, device=DEV, dtype=DT)
    r = torch.randn(m, n, device=DEV, dtype=DT)
    g = torch.rand(k, device=DEV, dtype=DT) + 0.5
    # Correctness of the fused call at this shape against fp32 torch.
    xf = x.float()
    if kind == "act_residual":
        xf = F.silu(xf[:, :k]) * xf[:, k:]
    if kind == "norm":
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * g.float()
    want = xf @ ws[0][name].float().t() + (r.float() if kind != "norm" else 0)
    got = _call(kind, x, ws[0][name], r, g, None).float()
    err = ((got - want).abs().max() / want.abs().max()).item()
    xk = x[:, :k].contiguous()
    sets = len(ws)
    row: dict = {"M": m, "gemm": name, "rel_err": err}
    row["cublas_us"] = time_graph(lambda i: F.linear(xk, ws[i][name]), sets) * 1e6
    row["default_us"] = time_graph(lambda i: _call(kind, x, ws[i][name], r, g, None), sets) * 1e6
    timed = []
    for cfg in sweep:
        us = time_graph(lambda i, c=cfg: _call(kind, x, ws[i][name], r, g, c), sets) * 1e6
        timed.append((us, cfg))
    timed.sort(key=lambda t: t[0])
    row["best_us"], row["config"] = timed[0]
    row["top3"] = [f"{_name(c)}: {u:.2f}" for u, c in timed[:3]]
    return row


def _name(c: RowsGemmConfig) -> str:
    split = f" k/{c.split_k}" if c.split_k > 1 else ""
    return f"{c.block_m}x{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages}{split}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="3 configs per shape")
    parser.add_argument("--rows", default="64,214", help="M values (comma-separated)")
    args = parser.parse_args()
    torch.manual_seed(0)
    ws = _weights(LAYERS)
    sweep = _sweep(args.quick)
    summary = []
    for m in [int(v) for v in args.rows.split(",")]:
        default = probe_layer(m, ws, {})
        print("default configs:", json.dumps(default), flush=True)
        best: Configs = {}
        for name in SHAPES:
            row = probe_shape(m, name, ws, sweep)
            best[name] = row.pop("config")
            print(
                json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
            )
            summary.append(
                (m, name, row["cublas_us"], row["default_us"], row["best_us"], _name(best[name]))
            )
        tuned = probe_layer(m, ws, best)
        print("best configs:", json.dumps(tuned), flush=True)
        summary.append(
            (
                m,
                "layer",
                default["cublas_layer_us"],
                default["fused_layer_us"],
                tuned["fused_layer_us"],
                "",
            )
        )
    print(f"\n{'M':>4} {'gemm':>8} {'cublas_us':>9} {'default_us':>10} {'best_us':>8}  best")
    for m, name, c, d, b, cfg in summary:
        print(f"{m:>4} {name:>8} {c:>9.2f} {d:>10.2f} {b:>8.2f}  {cfg}")
    print("(default configs: " + ", ".join(
        f"{n}@{m}: {_name(default_rows_config(m, *SHAPES[n][:2]))}" for n in SHAPES for m in (64, 214)
    ) + ")")  # fmt: skip


if __name__ == "__main__":
    main()
