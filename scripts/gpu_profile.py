"""Where a GPU step's time goes: host phases of the scheduler loop, and the kernels of a step.

PYTHONPATH=. python3 scripts/gpu_profile.py [--parts w1,w2] [--host-detail]

- w1: the W1 workload (Qwen3-0.6B shape, dummy weights; --kv-cache-dtype) with each scheduler
  phase timed on the host: `schedule`, `forward_batch` (until it returns: input copies, graph
  replay or eager launches, sampling launches), `process` split into waiting for the step's
  tokens and the Python work after. Mean ms per step by step kind, against the step period;
  then the kernels of a mixed step and of decode steps at W1's batch sizes.
- w2: torch.profiler over 20 decode steps at batch 1 of the Llama-3-8B shape (--quantization
  fp8: FP8 weights): per-step kernel time, kernel count and the sum of gaps, against the
  measured step period.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from minisgl.benchmark.common import (
    batch_bucket,
    print_kernel_table,
    release_memory,
    synchronize,
)
from minisgl.benchmark.offline import TokenIdLLM, sampling_params, w1_workload
from minisgl.core import Req, SamplingParams

MODELS = Path(
    os.environ.get("PROFILE_MODELS")
    or Path(__file__).resolve().parent.parent / "minisgl" / "benchmark" / "models"
)


def sync() -> None:
    synchronize(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


class PhaseTimer:
    """Wraps scheduler/engine methods with host timers; groups by the step's kind."""

    def __init__(self, llm: Any, host_detail: bool = False) -> None:
        self.sched, self.engine = llm.scheduler, llm.engine
        self.host_detail = cProfile.Profile() if host_detail else None
        self.acc: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.kind = "idle"
        self.launches: list[tuple[float, str]] = []
        s, e = self.sched, self.engine
        self.orig = (s.schedule, e.forward_batch, s.process)

        def schedule() -> Any:
            t = time.perf_counter()
            b = self.orig[0]()
            self.acc["_sched"]["schedule"] += time.perf_counter() - t
            return b

        def forward(batch: Any, mask: Any = None) -> Any:
            kind = "mixed" if batch.num_tokens != batch.size else batch_bucket(batch.size)
            t = time.perf_counter()
            self.launches.append((t, kind))
            if kind == "mixed" and self.host_detail is not None:
                # Python time by function, and a warning at every op that syncs with the GPU.
                torch.cuda.set_sync_debug_mode("warn")
                self.host_detail.enable()
                out = self.orig[1](batch, mask)
                self.host_detail.disable()
                torch.cuda.set_sync_debug_mode(0)
            else:
                out = self.orig[1](batch, mask)
            self.acc[kind]["forward_host"] += time.perf_counter() - t
            self.acc[kind]["steps"] += 1
            self.kind = kind
            return out

        def process(step: Any) -> Any:
            t = time.perf_counter()
            step.out.wait()
            t1 = time.perf_counter()
            ev = self.orig[2](step)
            batch = step.batch
            kind = "mixed" if batch.num_tokens != batch.size else batch_bucket(batch.size)
            self.acc[kind]["wait"] += t1 - t
            self.acc[kind]["process_py"] += time.perf_counter() - t1
            return ev

        s.schedule, e.forward_batch, s.process = schedule, forward, process

    def table(self, end: float) -> None:
        periods: dict[str, float] = defaultdict(float)
        times = self.launches + [(end, "")]
        for (t0, k), (t1, _) in zip(times, times[1:]):
            periods[k] += t1 - t0
        print(f"{'kind':<16}{'steps':>7}{'period':>9}{'fwd_host':>10}{'wait':>8}{'proc_py':>9}")
        for k in sorted(periods, key=lambda k: (k != "mixed", k)):
            a = self.acc[k]
            n = max(1, a["steps"])
            print(
                f"{k:<16}{int(a['steps']):>7}{periods[k] / n * 1e3:>9.2f}"
                f"{a['forward_host'] / n * 1e3:>10.2f}{a['wait'] / n * 1e3:>8.2f}"
                f"{a['process_py'] / n * 1e3:>9.2f}"
            )
        steps = sum(a["steps"] for k, a in self.acc.items() if k != "_sched")
        print(f"schedule(): {self.acc['_sched']['schedule'] / max(1, steps) * 1e3:.2f} ms/step")


def run_w1(scale: float, host_detail: bool = False, kv_cache_dtype: str = "auto") -> None:
    wl = w1_workload(256, scale)
    llm = TokenIdLLM(
        str(MODELS / "qwen3-0.6b"),
        load_format="dummy",
        show_progress=False,
        max_prefill_tokens=8192,
        kv_cache_dtype=kv_cache_dtype,
    )
    rng_prompts = [[(t * 7 + 3) % 10000 for t in p] for p in wl.prompts[:16]]
    llm.generate(rng_prompts, SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    timer = PhaseTimer(llm, host_detail)
    sync()
    t = time.perf_counter()
    llm.generate(wl.prompts, sampling_params(wl), use_tqdm=False)
    sync()
    end = time.perf_counter()
    print(f"\n== w1 (scale {scale}, KV {kv_cache_dtype}): {end - t:.2f} s, phases in ms per step")
    timer.table(end)
    if timer.host_detail is not None:
        print("\n== host time of the mixed steps' forward_batch, by function (top 30 by own time)")
        pstats.Stats(timer.host_detail).sort_stats("tottime").print_stats(30)
    run_mixed_and_decode(llm)


def run_mixed_and_decode(llm: Any) -> None:
    from torch.profiler import ProfilerActivity, profile

    sched = llm.scheduler
    params = SamplingParams(max_tokens=2000, temperature=0.6, ignore_eos=True)
    for i in range(200):
        sched.add_request(Req(rid=f"d{i}", prompt_ids=[(i * 31 + j) % 9000 for j in range(300)],
                              params=params, seed=i))  # fmt: skip
    for _ in range(40):  # prefill them all, settle into decode
        sched.step()
    for i in range(14):
        sched.add_request(Req(rid=f"p{i}", prompt_ids=[(i * 17 + j) % 9000 for j in range(585)],
                              params=params, seed=i))  # fmt: skip
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sched.step()
        sched.step()
        sync()
    print("\n== mixed step (200 decodes + ~8k prefill tokens; 2 steps profiled)")
    print_kernel_table(prof, 1, top=18)
    for r in list(sched.running) + list(sched.waiting):
        sched.abort(r.rid)
    while sched.has_work:
        sched.step()
    # W1's decode steps: batch ~200 at contexts ~560-1080, the tail ~80 at ~500-2000.
    for batch, context in ((200, 820), (80, 1250)):
        profile_decode(llm, batch, context)


def profile_decode(llm: Any, batch: int, context: int) -> None:
    """Decode steps of `batch` requests at about `context` tokens: the step period without the
    profiler, then the kernels of 20 profiled steps."""
    from torch.profiler import ProfilerActivity, profile

    sched = llm.scheduler
    params = SamplingParams(max_tokens=2000, temperature=0.6, ignore_eos=True)
    for i in range(batch):
        sched.add_request(Req(rid=f"c{i}", prompt_ids=[(i * 13 + j) % 9000 for j in range(context)],
                              params=params, seed=i))  # fmt: skip
    while sched.waiting or any(r.num_computed < r.prompt_len for r in sched.running):
        sched.step()
    for _ in range(5):
        sched.step()
    sync()
    t = time.perf_counter()
    for _ in range(30):
        sched.step()
    sync()
    period = (time.perf_counter() - t) / 30
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            sched.step()
        sync()
    print(f"\n== decode, batch {len(sched.running)} at ~{context} tokens: period "
          f"{period * 1e3:.3f} ms (no profiler); 20 profiled steps")  # fmt: skip
    print_kernel_table(prof, 20, top=25)
    for r in list(sched.running):
        sched.abort(r.rid)
    while sched.has_work:
        sched.step()


def run_w2(tp_size: int = 1, quantization: str | None = None) -> None:
    from torch.profiler import ProfilerActivity, profile

    llm = TokenIdLLM(
        str(MODELS / "llama-3-8b"), load_format="dummy", show_progress=False,
        max_running_requests=4, max_context_len=512, cuda_graph_max_bs=4, tp_size=tp_size,
        quantization=quantization,
    )  # fmt: skip
    sched = llm.scheduler
    params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    sched.add_request(Req(rid="w2", prompt_ids=list(range(1, 129)), params=params, seed=0))
    for _ in range(30):
        sched.step()
    sync()
    gaps = []
    t = time.perf_counter()
    for _ in range(50):
        sched.step()
        t1 = time.perf_counter()
        gaps.append(t1 - t)
        t = t1
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            sched.step()
        sync()
    print(
        f"\n== w2 Llama-3-8B bs 1, tp {tp_size}, weights {quantization or 'bf16'} (rank 0's kernels): median step period {statistics.median(gaps) * 1e3:.3f} ms"
    )
    print_kernel_table(prof, 20, top=25)
    sched.abort("w2")
    while sched.has_work:
        sched.step()
    llm.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="w1,w2")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--tp-size", type=int, default=1, help="w2 only")
    ap.add_argument("--kv-cache-dtype", default="auto", help="w1 only (e.g. fp8_e4m3)")
    ap.add_argument("--quantization", default=None, help="w2 only (fp8)")
    ap.add_argument(
        "--host-detail",
        action="store_true",
        help="w1: cProfile and sync warnings of the mixed steps",
    )
    args = ap.parse_args()
    parts = args.parts.split(",")
    if "w1" in parts:
        run_w1(args.scale, args.host_detail, args.kv_cache_dtype)
        release_memory()
    if "w2" in parts:
        run_w2(args.tp_size, args.quantization)


if __name__ == "__main__":
    main()
