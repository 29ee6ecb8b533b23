"""Probe: which cuBLAS entry point is fastest for a batch-1 decode GEMM (y = W x, bf16)?

`F.linear(x [1, K], W [N, K])` (what the layers call; cuBLAS picks an nvjet GEMM, with split-K
and a separate reduce kernel for the tall-K shapes) against `torch.mv(W, x)` (cuBLAS GEMV) and
`W @ x` as an [N, K] x [K, 1] GEMM, for the Llama-3-8B shapes at tp 1 and 2 and the
Qwen3-30B-A3B attention shapes; CUDA graphs, weights rotated through >= 600 MB so L2 never
holds them. Run on a GPU host: `PYTHONPATH=. python3 scripts/gemv_probe.py`.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from minisgl.benchmark.common import time_graph

SHAPES = {
    "8b qkv": (6144, 4096),
    "8b o_proj": (4096, 4096),
    "8b gate_up": (28672, 4096),
    "8b down": (4096, 14336),
    "8b lm_head": (128256, 4096),
    "8b/tp2 qkv": (3072, 4096),
    "8b/tp2 o_proj": (4096, 2048),
    "8b/tp2 gate_up": (14336, 4096),
    "8b/tp2 down": (4096, 7168),
    "30b-a3b qkv": (5120, 2048),
    "30b-a3b o_proj": (2048, 4096),
}


def probe(n: int, k: int) -> dict[str, float]:
    dev = torch.device("cuda")
    sets = max(2, -(-(600 << 20) // (n * k * 2)))
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.01 for _ in range(sets)]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    xv, xc = x[0], x.t().contiguous()
    ref = F.linear(x, ws[0]).float()
    err = max(
        (torch.mv(ws[0], xv).float() - ref[0]).abs().max().item(),
        ((ws[0] @ xc).float()[:, 0] - ref[0]).abs().max().item(),
    )
    row = {"MB": n * k * 2 / 1e6, "max_abs_diff": err}
    row["linear_us"] = time_graph(lambda i: F.linear(x, ws[i]), sets) * 1e6
    row["mv_us"] = time_graph(lambda i: torch.mv(ws[i], xv), sets) * 1e6
    row["gemm_n1_us"] = time_graph(lambda i: ws[i] @ xc, sets) * 1e6
    for name in ("linear", "mv", "gemm_n1"):
        row[f"{name}_TBps"] = row["MB"] / row[f"{name}_us"]
    return row


def main() -> None:
    torch.manual_seed(0)
    for name, (n, k) in SHAPES.items():
        row = probe(n, k)
        print(json.dumps({"gemm": name, **{k: round(v, 3) for k, v in row.items()}}), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
