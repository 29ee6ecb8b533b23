"""Probe: can a decode step at batch 1 hide weight reads behind its small kernels?

At batch 1 a Llama layer runs ~8 small kernels (norms, RoPE, attention) between its GEMMs,
during which HBM is idle. This probe measures, for the Llama-3-8B GEMM shapes (M = 1, bf16, in
CUDA graphs, weights rotated so L2 never holds them from one call to the next):
  cold      the GEMM alone
  pf        a Triton kernel that reads the weight into L2 (evict_last), alone
  pf+gemm   both in sequence: the GEMM's time from L2 is (pf+gemm) - pf
  chain+gemm        six small kernels (RMSNorm of one token) then the GEMM
  chain||pf+gemm    the same, with the prefetch on a side stream during the chain
and the GEMM alone with torch's other BLAS library (cublas vs cublaslt).
Run on a GPU host: `PYTHONPATH=. python3 scripts/l2_prefetch_probe.py`.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from minisgl.benchmark.common import time_graph
from minisgl.kernels.fused import rms_norm


@triton.jit
def _prefetch_kernel(w_ptr, sink_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(w_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_last")
        acc += x.to(tl.float32)
    s = tl.sum(acc, 0)
    if s == 1234.5:  # never true for these weights; keeps the loads alive
        tl.store(sink_ptr + pid, s)


def prefetch(w: torch.Tensor, sink: torch.Tensor, programs: int, block: int) -> None:
    _prefetch_kernel[(programs,)](w, sink, w.numel(), BLOCK=block, num_warps=4)


SHAPES = {
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}


def probe(n: int, k: int, sink: torch.Tensor, side: torch.cuda.Stream) -> dict[str, float]:
    """The figures of one GEMM shape (weights rotated through >= 600 MB)."""
    dev = sink.device
    sets = max(4, -(-(600 << 20) // (n * k * 2)))
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.01 for _ in range(sets)]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    h = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    nw = torch.ones(4096, device=dev, dtype=torch.bfloat16)
    row: dict[str, float] = {"MB": n * k * 2 / 1e6}

    def gemm(i: int) -> None:
        F.linear(x, ws[i])

    def chain() -> None:
        y = h
        for _ in range(6):
            y = rms_norm(y, nw, 1e-6)[0]

    row["cold_us"] = time_graph(gemm, sets) * 1e6
    for progs, block in ((132, 4096), (264, 4096), (264, 8192), (528, 2048)):

        def pf(i: int, p: int = progs, b: int = block) -> None:
            prefetch(ws[i], sink, p, b)

        def pf_gemm(i: int, p: int = progs, b: int = block) -> None:
            prefetch(ws[i], sink, p, b)
            F.linear(x, ws[i])

        t_pf = time_graph(pf, sets) * 1e6
        row[f"pf_us[{progs}x{block}]"] = t_pf
        row[f"l2_gemm_us[{progs}x{block}]"] = time_graph(pf_gemm, sets) * 1e6 - t_pf

    def chain_gemm(i: int) -> None:
        chain()
        F.linear(x, ws[i])

    def chain_pf_gemm(i: int) -> None:
        main_s = torch.cuda.current_stream()
        side.wait_stream(main_s)
        with torch.cuda.stream(side):
            prefetch(ws[i], sink, 264, 4096)
        chain()
        main_s.wait_stream(side)
        F.linear(x, ws[i])

    row["chain_us"] = time_graph(lambda i: chain(), 1) * 1e6
    row["chain+gemm_us"] = time_graph(chain_gemm, sets) * 1e6
    row["chain||pf+gemm_us"] = time_graph(chain_pf_gemm, sets) * 1e6
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        row[f"cold_us[{lib}]"] = time_graph(gemm, sets) * 1e6
    torch.backends.cuda.preferred_blas_library("default")
    row["cold_TBps"] = row["MB"] / row["cold_us"]  # MB/us = TB/s
    return row


def main() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    sink = torch.zeros(4096, device=dev)
    side = torch.cuda.Stream()
    for name, (n, k) in SHAPES.items():
        row = probe(n, k, sink, side)
        print(json.dumps({"gemm": name, **{k: round(v, 2) for k, v in row.items()}}))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
