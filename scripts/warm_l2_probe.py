"""Does warming L2 ahead of a batch-1 GEMV pay on the H200? A Llama-3-8B FP8 layer's four GEMVs
with a spin kernel for RoPE + attention between qkv and o_proj, timed as CUDA graphs of 8
layers' weights (DRAM-cold each time), with the bulk L2 prefetch (`warm_l2`) issued from
different places: the qkv GEMV's end (`gemv(warm=...)`), or a kernel of its own before the gap
with P programs of one warp each. Then o_proj alone after the gap, with and without its weight
warmed first, for what an L2 hit is worth to it.

    python scripts/warm_l2_probe.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.benchmark.common import time_graph
from minisgl.kernels.common import pdl_args, pdl_prologue, warm_chunk, warm_l2
from minisgl.kernels.gemv import default_config, gemv

DEV = "cuda"
H, QKV, INTER = 4096, 6144, 14336


@triton.jit
def _warm_kernel(ptr, nbytes, chunk, LANES: tl.constexpr, PDL: tl.constexpr):
    warm_l2(ptr, nbytes, chunk, tl.program_id(0), LANES)
    pdl_prologue(PDL)


def warm_kernel(t: torch.Tensor, programs: int) -> None:
    flat = t.view(-1).view(torch.uint8)
    nbytes, chunk = warm_chunk(flat.numel(), programs, 32)
    _warm_kernel[(programs,)](flat, nbytes, chunk, LANES=32, num_warps=1, **pdl_args(t.device))


def fp8(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, device=DEV) * k**-0.5
    s = w.abs().amax(1) / 448
    return (w / s[:, None]).to(torch.float8_e4m3fn), s.float()


def main() -> None:
    sets = 8
    ws = [(fp8(QKV, H), fp8(H, H), fp8(2 * INTER, H), fp8(H, INTER)) for _ in range(sets)]
    g = torch.rand(H, device=DEV, dtype=torch.bfloat16) + 0.5
    x0 = torch.randn(1, H, device=DEV, dtype=torch.bfloat16)
    att = torch.randn(1, H, device=DEV, dtype=torch.bfloat16)
    cycles = int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * 10e-6)  # ~10 us

    def lin(x, w, **kw):
        (wt, s), n, k = w, w[0].shape[0], w[0].shape[1]
        return gemv(
            x, wt, weight_scale=s, config=default_config(n, k, kw.get("act", False), True), **kw
        )

    def layer(i: int, where: str = "none", mb: float = 0.0, programs: int = 132) -> torch.Tensor:
        wq, wo, wgu, wd = ws[i]
        o_b = wo[0].view(-1).view(torch.uint8)
        gu_b = wgu[0].view(-1).view(torch.uint8)
        extra = int(mb * 2**20)
        warm = (o_b,) + ((gu_b[:extra],) if extra else ())
        lin(x0, wq, norm_weight=g, warm=warm if where == "gemv_end" else ())
        if where == "kernel":
            warm_kernel(o_b, programs)
            if extra:
                warm_kernel(gu_b[:extra], programs)
        torch.cuda._sleep(cycles)
        r = lin(att, wo, residual=x0)
        up = lin(r, wgu, norm_weight=g)
        return lin(up, wd, residual=r, act=True)

    rows = []
    for name, kw in [
        ("none", {}),
        ("gemv_end o", dict(where="gemv_end")),
        ("gemv_end o+24MB gu", dict(where="gemv_end", mb=24)),
        ("kernel P132 o", dict(where="kernel", programs=132)),
        ("kernel P16 o", dict(where="kernel", programs=16)),
        ("kernel P528 o", dict(where="kernel", programs=528)),
        ("kernel P132 o+24MB gu", dict(where="kernel", mb=24, programs=132)),
        ("none", {}),
    ]:
        us = time_graph(lambda i, kw=kw: layer(i, **kw), sets) * 1e6
        rows.append((f"layer {name}", us))

    def o_alone(i: int, warm: str) -> torch.Tensor:
        wo = ws[i][1]
        if warm == "kernel":
            warm_kernel(wo[0], 132)
        torch.cuda._sleep(cycles)
        return lin(att, wo, residual=x0)

    for warm in ("none", "kernel", "none"):
        rows.append(
            (
                f"sleep+o_proj warm={warm}",
                time_graph(lambda i, warm=warm: o_alone(i, warm), sets) * 1e6,
            )
        )
    rows.append(("sleep alone", time_graph(lambda i: torch.cuda._sleep(cycles), sets) * 1e6))
    for name, us in rows:
        print(f"{name:32} {us:8.2f} us")


if __name__ == "__main__":
    main()
