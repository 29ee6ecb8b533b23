"""Probe: ways to call the GEMMs of a W1 decode step (Qwen3-0.6B shape, M = batch rows) through
torch, each timed in a CUDA graph over 28 distinct weights (L2 never holds them):

- linear: `F.linear(x, w)` with w [N, K], as the model runs it (cuBLAS, torch's default library);
- lt: the same under `torch.backends.cuda.preferred_blas_library("cublaslt")`;
- mm_t: `x @ w_t` with the weight stored transposed, w_t [K, N] contiguous (another layout,
  another kernel choice);
- split2 / split4: K in 2 or 4 slices as one batched GEMM plus a sum (more blocks for the
  narrow N = 1024 projections).

The decode-step profile shows these GEMMs at 0.77-0.9 ms per step against ~0.28 ms of weight
reads. Run on a GPU host: `PYTHONPATH=. python3 scripts/decode_gemm_probe.py`.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

from minisgl.benchmark.common import time_graph

SHAPES = {
    "qkv": (4096, 1024),
    "o_proj": (1024, 2048),
    "gate_up": (6144, 1024),
    "down": (1024, 3072),
}
ROWS = (64, 80, 128, 200, 256)
LAYERS = 28
DEV = torch.device("cuda")
DT = torch.bfloat16


def _variants(
    x: torch.Tensor, ws: list[torch.Tensor], wts: list[torch.Tensor]
) -> dict[str, Callable[[int], object]]:
    k = x.shape[1]
    out: dict[str, Callable[[int], object]] = {
        "linear": lambda i: F.linear(x, ws[i]),
        "mm_t": lambda i: torch.mm(x, wts[i]),
    }
    for s in (2, 4):
        xs = x.view(x.shape[0], s, k // s).transpose(0, 1)  # [s, M, K/s]

        def split(i: int, s: int = s, xs: torch.Tensor = xs) -> object:
            return torch.bmm(xs, wts[i].view(s, k // s, -1)).sum(0)

        out[f"split{s}"] = split
    return out


def main() -> None:
    torch.manual_seed(0)
    default_lib = torch.backends.cuda.preferred_blas_library()
    print(f"torch {torch.__version__}, default BLAS library {default_lib}")
    rows: list[tuple[str, int, float, dict[str, float]]] = []  # gemm, M, MB, us per variant
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device=DEV, dtype=DT) * k**-0.5 for _ in range(LAYERS)]
        wts = [w.t().contiguous() for w in ws]
        mb = round(n * k * 2 / 1e6, 1)
        for m in ROWS:
            x = torch.randn(m, k, device=DEV, dtype=DT)
            want = F.linear(x.float(), ws[0].float())
            us: dict[str, float] = {}
            variants = _variants(x, ws, wts)
            for label, fn in variants.items():
                got = fn(0)
                assert isinstance(got, torch.Tensor)
                err = ((got.float() - want).abs().max() / want.abs().max()).item()
                assert err < 2e-2, (label, err)
                us[label] = round(time_graph(fn, LAYERS) * 1e6, 2)
            torch.backends.cuda.preferred_blas_library("cublaslt")
            us["lt"] = round(time_graph(variants["linear"], LAYERS) * 1e6, 2)
            torch.backends.cuda.preferred_blas_library(default_lib)
            rows.append((name, m, mb, us))
            print(json.dumps({"gemm": name, "M": m, "MB": mb, **us}))
    labels = ["linear", "lt", "mm_t", "split2", "split4"]
    print("\nmicroseconds per GEMM (28 distinct weights in a graph)")
    print(f"{'gemm':>8} {'M':>4} {'MB':>5} " + " ".join(f"{x:>7}" for x in labels))
    for name, m, mb, us in rows:
        print(f"{name:>8} {m:>4} {mb:>5} " + " ".join(f"{us[x]:>7}" for x in labels))
    for m in ROWS:
        tot = {x: sum(us[x] for _, mm, _, us in rows if mm == m) for x in labels}
        print(f"layer sum M={m}: " + ", ".join(f"{x} {v:.1f}" for x, v in tot.items()))


if __name__ == "__main__":
    main()
