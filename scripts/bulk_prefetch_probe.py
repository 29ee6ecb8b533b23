"""Probe: can the HBM-idle stretches of a batch-1 decode step prefetch the next weights into L2?

At batch 1 a layer's RoPE/KV-store and attention kernels (and a MoE layer's router and routing)
read next to nothing while HBM idles for several microseconds; the projection after them then
streams its weights from HBM. Hopper's bulk prefetch (`cp.async.bulk.prefetch.L2.global`, done
by the TMA unit: a few instructions, no SM time) could start those weights moving into L2
during the idle stretch. This measures, for the one-row GEMV (`minisgl.kernels.gemv`) at the
Qwen3-30B-A3B o_proj and qkv shapes and the Llama-3-8B o_proj, in CUDA graphs, with weights
rotated so that L2 never holds them from one call to the next:

  cold          a chain of small kernels (standing in for RoPE + attention), then the GEMV
  prefetched    the same chain, its first kernel also prefetching the GEMV's weight into L2
  from_l2       the GEMV right after a full read of its weight (the best prefetching can do)

Run on a GPU host: `PYTHONPATH=. python3 scripts/bulk_prefetch_probe.py` (sm_90+).
"""

from __future__ import annotations

import json

import torch
import triton
import triton.language as tl

from minisgl.benchmark.common import time_graph
from minisgl.kernels.gemv import gemv

SHAPES = {"30b-a3b o_proj": (2048, 4096), "30b-a3b qkv": (5120, 2048), "8b o_proj": (4096, 4096)}
SMALL_KERNELS = 4  # RoPE/store and attention are two, each with a ramp; a few more for margin
DEV = torch.device("cuda")
DT = torch.bfloat16


@triton.jit
def _idle_kernel(x_ptr, w_ptr, nbytes, PREFETCH: tl.constexpr, THREADS: tl.constexpr):
    """A latency-bound small kernel (reads and writes 128 floats); with PREFETCH its threads
    also split [w_ptr, w_ptr + nbytes) into THREADS chunks and bulk-prefetch them into L2."""
    offs = tl.arange(0, THREADS)
    x = tl.load(x_ptr + offs)
    if PREFETCH:
        chunk = (nbytes // THREADS) // 16 * 16  # the instruction takes multiples of 16 bytes
        ptrs = w_ptr.to(tl.pointer_type(tl.int8)) + offs.to(tl.int64) * chunk
        sizes = tl.full([THREADS], 0, tl.int32) + chunk
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
            "=r,l,r",
            [ptrs, sizes],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    tl.store(x_ptr + offs, x * 1.0001)


def idle(x: torch.Tensor, w: torch.Tensor, prefetch: bool) -> None:
    _idle_kernel[(1,)](x, w, w.numel() * w.element_size(), PREFETCH=prefetch, THREADS=128)


def probe(name: str, n: int, k: int) -> dict[str, object]:
    sets = max(4, -(-(600 << 20) // (n * k * 2)))  # > L2: every call's weight comes from HBM
    ws = [torch.randn(n, k, device=DEV, dtype=DT) * k**-0.5 for _ in range(sets)]
    x = torch.randn(1, k, device=DEV, dtype=DT)
    r = torch.randn(1, n, device=DEV, dtype=DT)
    scratch = torch.randn(128, device=DEV)

    def chain(i: int, prefetch: bool) -> torch.Tensor:
        idle(scratch, ws[i], prefetch)
        for _ in range(SMALL_KERNELS - 1):
            idle(scratch, ws[i], False)
        return gemv(x, ws[i], residual=r)

    def from_l2(i: int) -> torch.Tensor:
        ws[i].sum()  # reads the whole weight: it is in L2 (as far as it fits) for the GEMV
        return gemv(x, ws[i], residual=r)

    def small_only(i: int) -> None:
        for _ in range(SMALL_KERNELS):
            idle(scratch, ws[i], False)

    def read_only(i: int) -> torch.Tensor:
        return ws[i].sum()

    us = {
        "cold": time_graph(lambda i: chain(i, False), sets) * 1e6,
        "prefetched": time_graph(lambda i: chain(i, True), sets) * 1e6,
        "small_kernels_alone": time_graph(small_only, sets) * 1e6,
        "from_l2_minus_read": (time_graph(from_l2, sets) - time_graph(read_only, sets)) * 1e6,
    }
    got = chain(0, True)
    want = (x.float() @ ws[0].float().t() + r.float()).to(DT)
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    return {"gemv": name, "MB": round(n * k * 2 / 1e6, 1), "rel_err": err} | {
        key: round(v, 2) for key, v in us.items()
    }


def main() -> None:
    torch.manual_seed(0)
    rows = [probe(name, n, k) for name, (n, k) in SHAPES.items()]
    for row in rows:
        print(json.dumps(row))
    cols = ("gemv", "MB", "cold", "prefetched", "small_kernels_alone", "from_l2_minus_read")
    print("\n" + "  ".join(f"{c:>18}" for c in cols))
    for row in rows:
        print("  ".join(f"{row[c]!s:>18}" for c in cols))


if __name__ == "__main__":
    main()
