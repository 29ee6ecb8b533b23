"""Greedy tokens and log-probs at tp=1 and tp=N on the same dummy model (run on a multi-GPU host).

python scripts/tp_tokens.py [--model minisgl/benchmark/models/llama-3-8b] [--tp-size 2]

Tokens must agree up to the first position where tp=1's two best log-probs are within 5e-2
(bf16 rounding differs between the two all-reduce orders); prints one line per prompt and a
JSON summary last.
"""

from __future__ import annotations

import argparse
import json
import random

from minisgl import LLM, SamplingParams

TOL = 5e-2


def run(model: str, tp: int, prompts: list[list[int]], n: int) -> list[dict]:
    llm = LLM(
        model,
        load_format="dummy",
        tp_size=tp,
        max_context_len=512,
        num_pages=512,
        show_progress=False,
    )
    params = SamplingParams(
        max_tokens=n, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        close = getattr(llm, "close", None)
        if close is not None:
            close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="minisgl/benchmark/models/llama-3-8b")
    ap.add_argument("--tp-size", type=int, default=2)
    ap.add_argument("--num-tokens", type=int, default=32)
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(10000) for _ in range(rng.randint(16, 128))] for _ in range(8)]
    ref = run(args.model, 1, prompts, args.num_tokens)
    got = run(args.model, args.tp_size, prompts, args.num_tokens)
    worst, agree_ok, compared = 0.0, True, 0
    for i, (r, g) in enumerate(zip(ref, got)):
        same = 0
        for j, (rt, gt) in enumerate(zip(r["top_logprobs"], g["top_logprobs"])):
            worst = max(worst, abs(rt[0][1] - gt[0][1]))
            compared += 1
            tie = rt[0][1] - rt[1][1] < TOL
            if r["token_ids"][j] != g["token_ids"][j]:
                agree_ok &= tie
                break
            same += 1
            if tie:
                break
        print(
            f"prompt {i}: {same} tokens compared identical; tp1 {r['token_ids'][:8]} "
            f"tp{args.tp_size} {g['token_ids'][:8]}"
        )
    print(
        json.dumps(
            {
                "tp": args.tp_size,
                "tokens_agree": agree_ok,
                "positions": compared,
                "max_abs_logprob_diff": worst,
            }
        )
    )


if __name__ == "__main__":
    main()
