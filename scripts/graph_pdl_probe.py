"""Is it safe and faster to make the edges into cuBLAS GEMMs of a decode graph programmatic?

On a GPU host:  python3 scripts/graph_pdl_probe.py
1. Negative control: a Triton kernel that does not wait, launched with PDL after the late writer,
   must read the old input (shows that the check can see a race).
2. `graph_pdl.verify` at W1's (Qwen3-0.6B) and W2's (Llama-3-8B) projection shapes: per cuBLAS
   kernel name, whether it waited for the late writer.
3. A chain like a decode step's (28 x [norm-like Triton kernel, GEMM] x 4) replayed as a graph
   with and without the rewritten edges: us per GEMM.
"""

from __future__ import annotations

import json
import statistics

import torch
import triton
import triton.language as tl

from minisgl.engine import graph_pdl
from minisgl.kernels.common import pdl_args, pdl_prologue


@triton.jit
def _copy_no_wait(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


@triton.jit
def _scale(x_ptr, y_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n).to(tl.float32)
    tl.store(y_ptr + offs, (v * 0.5).to(y_ptr.dtype.element_ty), mask=offs < n)


def negative_control(dev: torch.device) -> bool:
    """True when a consumer without a wait reads the stale input (the race is visible)."""
    late = graph_pdl._late_writer()
    x = torch.zeros(4096, dtype=torch.bfloat16, device=dev)
    y = torch.empty_like(x)

    def step() -> None:
        late[(1,)](x, x.numel(), 20_000, BLOCK=1024, launch_pdl=True)
        _copy_no_wait[(4,)](x, y, x.numel(), BLOCK=1024, launch_pdl=True)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    x.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return bool((y == 0).all())


def chain_us(dev: torch.device, m: int, shapes: list[tuple[int, int]], pdl: bool) -> float:
    layers = 28
    ws = [[torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.01 for k, n in shapes]
          for _ in range(layers)]  # fmt: skip
    bufs = {k: torch.randn(m, k, dtype=torch.bfloat16, device=dev) for k, _ in shapes}
    outs = {n: torch.empty(m, n, dtype=torch.bfloat16, device=dev) for _, n in shapes}

    def step() -> None:
        for layer in ws:
            for (k, n), w in zip(shapes, layer):
                x = bufs[k]
                _scale[(triton.cdiv(x.numel(), 4096),)](
                    x, x, x.numel(), BLOCK=4096, **pdl_args(dev)
                )
                torch.mm(x, w.t(), out=outs[n])

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        step()
    n_edges = (
        graph_pdl.rewrite(graph.raw_cuda_graph(), lambda n: bool(graph_pdl.GEMM_NAME.search(n)))
        if pdl
        else 0
    )
    graph.instantiate()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    print(f"  chain m={m} pdl={pdl} edges={n_edges}: {statistics.median(times):.1f} us "
          f"({statistics.median(times) / (layers * len(shapes)):.2f} us per GEMM + norm)")  # fmt: skip
    return statistics.median(times)


def main() -> None:
    dev = torch.device("cuda", 0)
    print(
        "1. negative control (a consumer without a wait reads stale data):", negative_control(dev)
    )
    w1 = [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)]  # (K, N) of Qwen3-0.6B
    w2 = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # Llama-3-8B
    shapes = [(m, k, n) for m in (1, 8, 64, 136, 200, 256) for k, n in w1]
    shapes += [(m, k, n) for m in (1, 64) for k, n in w2]
    shapes += [(m, 1024, 151936) for m in (8, 200)]  # LM head
    res = graph_pdl.verify(shapes, torch.bfloat16, dev)
    print("2. GEMM kernels that waited for the late writer:")
    for name, ok in sorted(res.items()):
        print(f"  {'waits ' if ok else 'RACES '} {name[:110]}")
    print("3. decode-like chain, graph replay:")
    rows = {}
    for m in (8, 64, 200):
        off = chain_us(dev, m, w1, False)
        on = chain_us(dev, m, w1, True)
        rows[m] = (round(off, 1), round(on, 1))
    print(json.dumps({"all_wait": all(res.values()), "kernels": len(res), "chain_us_off_on": rows}))


if __name__ == "__main__":
    main()
