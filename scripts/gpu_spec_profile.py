"""Where a speculative step's host time goes: the copy workload of
`minisgl.benchmark.speculative` (SmolLM2, n-gram) under cProfile, speculation on, after a
warm-up run; prints the functions with the most own time and the most cumulative time.
`--workload chat`: the chat prompt instead (where drafts are rare, so speculating costs only
its per-step checks and the waits for tokens in flight that found no draft).
    python3 scripts/gpu_spec_profile.py [--num-draft-tokens K] [--off] [--workload chat]"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from minisgl.benchmark.speculative import CHAT_TOPICS, COPY_TASK, PASSAGE, chat_ids
from minisgl.core import SamplingParams
from minisgl.llm import LLM


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--tokens", type=int, default=320)
    p.add_argument("--off", action="store_true", help="speculation off (the baseline's profile)")
    p.add_argument("--workload", default="copy", choices=["copy", "chat"])
    args = p.parse_args()
    llm = LLM(
        speculative_algorithm="ngram",
        speculative_num_draft_tokens=args.num_draft_tokens,
        show_progress=False,
    )
    if args.off:
        llm.scheduler.spec = None
    text = COPY_TASK + PASSAGE if args.workload == "copy" else CHAT_TOPICS[0]
    prompt = chat_ids(llm, text)
    params = SamplingParams(max_tokens=args.tokens, temperature=0)
    for _ in range(2):
        llm.scheduler.flush_cache()
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        took = time.perf_counter() - start
    spec = llm.scheduler.spec
    print(f"{len(out['token_ids'])} tokens in {took * 1e3:.1f} ms; {spec.stats if spec else ''}")
    llm.scheduler.flush_cache()
    prof = cProfile.Profile()
    prof.enable()
    llm.generate([prompt], params, use_tqdm=False)
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(22)
    stats.sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
