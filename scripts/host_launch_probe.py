"""Probe: why does an eager mixed step (an 8k-token prefill chunk plus ~200 decodes, ~700 kernels)
spend ~23 ms on the host when its kernels take ~12 ms on the GPU?

1. Host microseconds per `F.linear` call at prefill sizes: the same M every call, against a new
   M every call (cuBLAS picks an algorithm per shape), with the GPU idle.
2. Host microseconds per launch of a small Triton kernel (`rms_norm`) and of `F.linear`, while
   the GPU is busy with a long kernel: after how many pending launches does a launch block
   (the launch queue is full)?
Run on a GPU host: `PYTHONPATH=. python3 scripts/host_launch_probe.py`.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
import torch.nn.functional as F

from minisgl.kernels.fused import rms_norm


def host_us(fn, n: int) -> list[float]:
    out = []
    for i in range(n):
        t = time.perf_counter()
        fn(i)
        out.append((time.perf_counter() - t) * 1e6)
    return out


def main() -> None:
    dev = torch.device("cuda")
    w = torch.randn(4096, 1024, device=dev, dtype=torch.bfloat16)
    xs = {m: torch.randn(m, 1024, device=dev, dtype=torch.bfloat16) for m in range(8192, 8392)}
    for x in xs.values():  # allocate outputs once
        F.linear(x[:16], w)
    torch.cuda.synchronize()
    res: dict[str, object] = {}
    same = host_us(lambda i: F.linear(xs[8192], w), 100)
    torch.cuda.synchronize()
    new = host_us(lambda i: F.linear(xs[8193 + i], w), 100)
    torch.cuda.synchronize()
    again = host_us(lambda i: F.linear(xs[8193 + i], w), 100)
    torch.cuda.synchronize()
    res["linear_same_m_us"] = statistics.median(same)
    res["linear_new_m_us"] = statistics.median(new)
    res["linear_seen_m_again_us"] = statistics.median(again)
    res["linear_new_m_first10_us"] = [round(t) for t in new[:10]]
    print(json.dumps(res), flush=True)

    h = torch.randn(8, 1024, device=dev, dtype=torch.bfloat16)
    nw = torch.ones(1024, device=dev, dtype=torch.bfloat16)
    rms_norm(h, nw, 1e-6)
    torch.cuda.synchronize()
    idle = host_us(lambda i: rms_norm(h, nw, 1e-6), 200)
    res["triton_rms_norm_idle_us"] = statistics.median(idle)
    # GPU busy for ~200 ms: how many launches before one blocks?
    for name, fn in (("rms_norm", lambda i: rms_norm(h, nw, 1e-6)),
                     ("linear_small", lambda i: F.linear(h, w))):  # fmt: skip
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e8))  # ~100-200 ms of spinning
        ts = host_us(fn, 3000)
        blocked = [i for i, t in enumerate(ts) if t > 1000]
        res[f"{name}_busy_first_blocking_launch"] = blocked[:5]
        res[f"{name}_busy_median_us"] = statistics.median(ts)
        res[f"{name}_busy_total_ms"] = sum(ts) / 1e3
        torch.cuda.synchronize()
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in res.items()}))


if __name__ == "__main__":
    main()
