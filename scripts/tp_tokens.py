"""Greedy tokens at tp=1 and tp=N on the same dummy model, one engine after the other (run on a
multi-GPU host; about a minute for the 8B shape):

    python scripts/tp_tokens.py [--model minisgl/benchmark/models/llama-3-8b] [--tp-size 2]

bf16 sums in a different order at tp=N (the all-reduce splits them), so tokens may rightly part
where tp=1's two best log-probs are within the tolerance: each prompt must agree up to its first
difference, and there tp=1's top-2 gap must be below it. The tolerance is TOL or this model's own
bf16 noise, whichever is larger: the largest log-prob difference between tp=1 and a second tp=1
run on the reference path (torch attention and layers, eager), which sums in another order too.
(Dummy weights give nearly flat distributions whose logits are large enough that one bf16 step
of a logit exceeds TOL.) Prints one line per prompt, a JSON summary, and PASS or FAIL last (exit
status 1 on FAIL).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # minisgl without installing it

import torch  # noqa: E402

from minisgl import LLM, SamplingParams  # noqa: E402
from minisgl.weights import load_model_config, resolve_source  # noqa: E402

TOL = 5e-2
# Small on purpose: a few CUDA graphs and a tiny pool keep each engine's start to seconds.
ENGINE = dict(
    load_format="dummy",
    max_context_len=256,
    num_pages=128,
    max_running_requests=8,
    cuda_graph_max_bs=8,
    show_progress=False,
)


def run(
    model: str, tp: int, prompts: list[list[int]], n: int, reference: bool = False
) -> tuple[list[dict], float]:
    from minisgl.layers.fused import set_fused_enabled

    start = time.perf_counter()
    params = SamplingParams(
        max_tokens=n, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    options: dict[str, Any] = dict(ENGINE)
    if reference:
        options.update(attention_backend="torch", cuda_graph_max_bs=0, overlap=False)
    set_fused_enabled(not reference)
    try:
        with LLM(model, tp_size=tp, **options) as llm:
            out = llm.generate(prompts, params, use_tqdm=False)
    finally:
        set_fused_enabled(True)
    del llm
    gc.collect()  # the next engine needs the memory
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out, time.perf_counter() - start


def compare(ref: dict[str, Any], got: dict[str, Any], tol: float = TOL) -> dict[str, Any]:
    """Where `got` first parts from `ref`, and whether tp=1 saw a near tie there."""
    row: dict[str, Any] = {"first_diff": None, "gap": None, "ok": True, "max_lp_diff": 0.0}
    for j, (rt, gt) in enumerate(zip(ref["top_logprobs"], got["top_logprobs"])):
        if ref["token_ids"][j] != got["token_ids"][j]:
            gap = rt[0][1] - rt[1][1]
            row.update(first_diff=j, gap=gap, ok=gap < tol)
            return row
        # Past the first difference the contexts differ: compare only the shared prefix.
        row["max_lp_diff"] = max(row["max_lp_diff"], abs(rt[0][1] - gt[0][1]))
    return row


def describe(i: int, row: dict[str, Any], ref: dict, got: dict, tp: int, tol: float) -> str:
    if row["first_diff"] is None:
        return f"prompt {i}: all {len(ref['token_ids'])} tokens identical"
    j = row["first_diff"]
    verdict = "a near tie, allowed" if row["ok"] else f">= {tol:.4f}: WRONG"
    return (
        f"prompt {i}: first difference at position {j}: tp1 {ref['token_ids'][j]} vs "
        f"tp{tp} {got['token_ids'][j]}; tp1 top-2 gap {row['gap']:.4f} ({verdict})"
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="minisgl/benchmark/models/llama-3-8b")
    ap.add_argument("--tp-size", type=int, default=2)
    ap.add_argument("--num-tokens", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=8)
    args = ap.parse_args()
    vocab = min(10000, load_model_config(resolve_source(args.model)).vocab_size)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(vocab) for _ in range(rng.randint(8, 32))] for _ in range(args.num_prompts)
    ]
    ref, t_ref = run(args.model, 1, prompts, args.num_tokens)
    alt, _ = run(args.model, 1, prompts, args.num_tokens, reference=True)
    noise = max(compare(r, a)["max_lp_diff"] for r, a in zip(ref, alt))
    tol = max(TOL, noise)
    got, t_got = run(args.model, args.tp_size, prompts, args.num_tokens)
    rows = [compare(r, g, tol) for r, g in zip(ref, got)]
    for i, (row, r, g) in enumerate(zip(rows, ref, got)):
        print(describe(i, row, r, g, args.tp_size, tol))
    passed = all(row["ok"] for row in rows)
    summary = {
        "tp": args.tp_size,
        "passed": passed,
        "tp1_bf16_noise": noise,
        "tolerance": tol,
        "prompts_identical": sum(row["first_diff"] is None for row in rows),
        "prompts": len(rows),
        "max_abs_logprob_diff_before_first_diff": max(row["max_lp_diff"] for row in rows),
        "seconds": {"tp1": round(t_ref, 1), f"tp{args.tp_size}": round(t_got, 1)},
    }
    print(json.dumps(summary))
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
