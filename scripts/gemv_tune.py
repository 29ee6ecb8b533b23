"""Batch-1 linear layers on the GPU: cuBLAS (`F.linear`) against the Triton GEMV's configs.

PYTHONPATH=. python3 scripts/gemv_tune.py

Each timing replays a CUDA graph that runs the op over enough weight copies (>= 512 MB) that
none is in L2 when it is read, as in a decode step; time per op = graph time / copies. Prints,
per shape, cuBLAS and the best GEMV config (us, TB/s), then a `TUNED` dict to paste into
minisgl/kernels/gemv.py (only shapes where the GEMV wins).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from minisgl.kernels.gemv import GemvConfig, gemv

# (N, K): Llama-3-8B / Qwen3-8B projections at tp 1 and tp 2.
SHAPES = [
    (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
    (3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168),
    (24576, 4096), (4096, 12288),
]  # fmt: skip
CONFIGS = [
    GemvConfig(bn, bk, w, s)
    for bn, bk, w, s in itertools.product((8, 16, 32), (256, 512), (4, 8), (2, 4))
]


def time_op(fn, weights: list[torch.Tensor], x: torch.Tensor) -> float:
    """Seconds per call, from a CUDA graph over every weight copy."""
    for w in weights[:2]:
        fn(x, w)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for w in weights:
            fn(x, w)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / len(weights))
    return best


def main() -> None:
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    tuned: dict[tuple[int, int], GemvConfig] = {}
    print(
        f"{'N':>6} {'K':>6} {'cublas_us':>10} {'TB/s':>6} {'gemv_us':>8} {'TB/s':>6}  best config"
    )
    for n, k in SHAPES:
        nbytes = n * k * 2
        copies = max(4, (512 << 20) // nbytes)
        ws = [torch.randn(n, k, device=dev, dtype=dtype) for _ in range(copies)]
        x = torch.randn(1, k, device=dev, dtype=dtype)
        ref = F.linear(x.float(), ws[0].float())
        t_cublas = time_op(lambda a, w: F.linear(a, w), ws, x)
        best_t, best_c = float("inf"), CONFIGS[0]
        for c in CONFIGS:
            y = gemv(x, ws[0], config=c)
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-2, f"{c}: relative error {err}"
            t = time_op(lambda a, w, c=c: gemv(a, w, config=c), ws, x)
            if t < best_t:
                best_t, best_c = t, c
        print(
            f"{n:>6} {k:>6} {t_cublas * 1e6:>10.1f} {nbytes / t_cublas / 1e12:>6.2f} "
            f"{best_t * 1e6:>8.1f} {nbytes / best_t / 1e12:>6.2f}  {best_c}"
        )
        if best_t < t_cublas:
            tuned[(n, k)] = best_c
        del ws
        torch.cuda.empty_cache()
    print("TUNED = {")
    for key, c in tuned.items():
        print(f"    {key}: GemvConfig({c.block_n}, {c.block_k}, {c.num_warps}, {c.num_stages}),")
    print("}")


if __name__ == "__main__":
    main()
