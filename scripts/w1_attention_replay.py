"""Why W1's decode attention reads slower inside the engine than in the kernel benchmark.

Runs W1 (Qwen3-0.6B shape, dummy weights, CUDA graphs off so the attention call is a Python
call) and, at the first decode-only attention call of `--batch-lo`..`--batch-hi` rows, times
`decode_attention` again on exactly that call's inputs (the engine's pool, block table, context
lengths): as it came, with the rows sorted longest first, and with other split counts. Prints
the fraction of the copy bandwidth of each, next to the kernel benchmark's synthetic ragged
batch of the same size and mean context, then stops the run.

    python scripts/w1_attention_replay.py [--kv-cache-dtype fp8_e4m3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any

import torch

import minisgl.attention.triton_backend as tb
from minisgl.benchmark.common import measure_bandwidth
from minisgl.benchmark.offline import TokenIdLLM, sampling_params, w1_workload
from minisgl.kernels.decode import decode_attention

MODEL = Path(__file__).resolve().parents[1] / "minisgl" / "benchmark" / "models" / "qwen3-0.6b"


class Captured(Exception):
    pass


def time_call(fn: Any, reps: int = 30) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e-3


def replay(args: Any, kw: dict[str, Any], copy_bw: float) -> list[dict[str, Any]]:
    q, k_cache, v_cache, table, lens, ps, scale = args
    elem = k_cache.element_size()
    heads_kv, dim = k_cache.shape[1], q.shape[2]
    lens_l = lens.tolist()
    nbytes = 2 * sum(lens_l) * heads_kv * dim * elem + 2 * q.numel() * q.element_size()
    perm = torch.argsort(lens, descending=True)
    variants = {
        "as captured": (q, table, lens, kw.get("num_splits")),
        "longest first": (
            q[perm].contiguous(),
            table[perm].contiguous(),
            lens[perm].contiguous(),
            kw.get("num_splits"),
        ),  # fmt: skip
        "shortest first": (
            q[perm.flip(0)].contiguous(),
            table[perm.flip(0)].contiguous(),
            lens[perm.flip(0)].contiguous(),
            kw.get("num_splits"),
        ),  # fmt: skip
        "2 splits": (q, table, lens, 2),
        "4 splits": (q, table, lens, 4),
    }
    rows = []
    for name, (qq, tt, ll, splits) in variants.items():
        out = torch.empty_like(qq)

        def call(qq=qq, tt=tt, ll=ll, splits=splits, out=out) -> None:
            decode_attention(qq, k_cache, v_cache, tt, ll, ps, scale, num_splits=splits,
                             config=kw.get("config"), out=out, kv_scales=kw.get("kv_scales"))  # fmt: skip

        sec = time_call(call)
        rows.append({"variant": name, "num_splits": splits, "us": sec * 1e6,
                     "fraction_of_copy": nbytes / sec / copy_bw})  # fmt: skip
    stats = {"batch": len(lens_l), "mean_context": sum(lens_l) / len(lens_l),
             "min": min(lens_l), "max": max(lens_l), "kv_dtype": str(k_cache.dtype),
             "page_size": ps, "engine_num_splits": kw.get("num_splits")}  # fmt: skip
    print(json.dumps(stats))
    for r in rows:
        print(f"  {r['variant']:16} splits {r['num_splits']}  {r['us']:8.1f} us  "
              f"fraction {r['fraction_of_copy']:.3f}")  # fmt: skip
    # the page scatter: how many of each row's consecutive pages are consecutive in the pool
    pages = [(table[i, : -(-n // ps)]).tolist() for i, n in enumerate(lens_l)]
    runs = sum(sum(1 for a, b in zip(p, p[1:]) if b == a + 1) for p in pages)
    total = sum(max(0, len(p) - 1) for p in pages)
    print(f"  consecutive page pairs: {runs} of {total}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--batch-lo", type=int, default=190)
    ap.add_argument("--batch-hi", type=int, default=210)
    a = ap.parse_args()
    copy_bw = measure_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s")
    state: dict[str, Any] = {}
    real = tb.decode_attention

    def hooked(*args: Any, **kw: Any) -> Any:
        out = real(*args, **kw)
        b = args[0].shape[0]
        if state.get("meta_decode_only") and a.batch_lo <= b <= a.batch_hi and "rows" not in state:
            torch.cuda.synchronize()
            state["rows"] = replay(args, kw, copy_bw)
            raise Captured
        return out

    tb.decode_attention = hooked
    real_forward = tb.TritonBackend.forward

    def forward(self: Any, q: Any, k: Any, v: Any, layer: int, meta: Any) -> Any:
        state["meta_decode_only"] = getattr(meta, "extend", 1) is None
        return real_forward(self, q, k, v, layer, meta)

    tb.TritonBackend.forward = forward  # type: ignore[method-assign]
    llm = TokenIdLLM(str(MODEL), load_format="dummy", cuda_graph_max_bs=0,
                     kv_cache_dtype=a.kv_cache_dtype, show_progress=False)  # fmt: skip
    wl = w1_workload()
    with contextlib.suppress(Captured):
        llm.generate(wl.prompts, sampling_params(wl), use_tqdm=False)
    if "rows" not in state:
        print("no decode-only step of that size was seen")


if __name__ == "__main__":
    main()
