"""Where the batch-1 one-launch FP8 MoE kernel's time goes (one H200): each variant of
`minisgl.kernels.moe.one_row_experts_fp8` (PHASE bits, routing, tiles, grid size) and the
two-launch pair kernels, timed as CUDA-graph replays of calls rotating over several layers'
expert stacks (Qwen3-30B-A3B shape, so the selected experts do not stay in L2). Prints us a call.
    python scripts/moe_one_launch_probe.py
"""

from __future__ import annotations

import torch

from minisgl.kernels import moe as K
from minisgl.kernels.fp8 import ExpertScales, quantize_rows

E, TOP_K, H, INTER, LAYERS, CALLS = 128, 8, 2048, 768, 6, 24


def stacks(seed: int) -> tuple[torch.Tensor, torch.Tensor, ExpertScales]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for n, k in ((2 * INTER, H), (H, INTER)):
        w = torch.randn(E * n, k, device="cuda", generator=g, dtype=torch.bfloat16) * k**-0.5
        q, s = quantize_rows(w)
        out.append((q.view(E, n, k), s.view(E, n)))
    (q13, s13), (q2, s2) = out
    return q13, q2, ExpertScales(s13, s2)


def timed(fn, layers) -> float:  # type: ignore[no-untyped-def]
    for i in range(LAYERS):
        fn(*layers[i])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in range(CALLS):
            fn(*layers[c % LAYERS])
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / (10 * CALLS))
    return best


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, H, device="cuda", generator=g, dtype=torch.bfloat16)
    norm = torch.ones(H, device="cuda", dtype=torch.bfloat16)
    layers = []
    for i in range(LAYERS):
        q13, q2, sc = stacks(i + 1)
        logits = torch.randn(1, E, device="cuda", generator=g, dtype=torch.bfloat16)
        layers.append((x, logits, q13, q2, sc))
    gu, dn = K.FP8_PAIR_TILES

    def two(x, logits, q13, q2, sc):  # type: ignore[no-untyped-def]
        act, routing = K.pair_gate_up(x, q13, TOP_K, gu, logits=logits, renormalize=True,
                                      norm_weight=norm, scale=sc.w13)  # fmt: skip
        return K.pair_down(act, q2, routing, TOP_K, dn, residual=x, scale=sc.w2)

    def one(**kw):  # type: ignore[no-untyped-def]
        def f(x, logits, q13, q2, sc):  # type: ignore[no-untyped-def]
            return K.one_row_experts_fp8(x, logits, q13, q2, sc, TOP_K, True, norm, 1e-6, **kw)

        return f

    rows = [("two launches (pair gate/up + pair down)", two)]
    rows += [
        ("one: route only (ranks)", one(phase=0)),
        ("one: route only (argmax rounds)", one(phase=0, ranks=False)),
        ("one: route + barrier", one(phase=4)),
        ("one: gate/up only", one(phase=1)),
        ("one: down only (preloaded, no barrier)", one(phase=2)),
        ("one: both, no barrier (racy: timing only)", one(phase=3)),
        ("one: full (4,4)", one()),
        ("one: full (4,4) argmax routing", one(ranks=False)),
        ("one: full (4,2)", one(tiles=(4, 2))),
        ("one: full (2,4)", one(tiles=(2, 4))),
        ("one: full (8,8)", one(tiles=(8, 8))),
        ("one: full (4,4) 264 programs", one(programs=264)),
    ]
    for name, fn in rows:
        try:
            print(f"{name:48s} {timed(fn, layers):8.2f} us", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{name:48s} failed: {type(e).__name__}: {str(e)[:150]}", flush=True)
    for key, resident in K._ONE_LAUNCH_PROGRAMS.items():
        f: dict[str, object] = dict(key[1])  # type: ignore[call-overload]
        print(f"tiles ({f['BLOCK_N_A']},{f['BLOCK_N_B']}) ranks={f['RANKS']}: {resident} resident")


if __name__ == "__main__":
    main()
