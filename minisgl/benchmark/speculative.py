"""Speculative decoding, on against off in one run: `python -m minisgl.benchmark.speculative`.

Workloads (greedy, through `LLM.generate`, on one engine: speculation is switched off for the
baseline by taking the scheduler's policy away, so both runs share weights, pool and graphs):
- copy: one stream rewriting a given passage of code with a small edit (the answer copies most
  of the prompt: what prompt lookup is for);
- chat: one stream of open-ended chat;
- concurrent: `--concurrency` chat requests at once.
Each prints output tokens/s off and on, their ratio, the mean accepted length (tokens a verify
step gained per request, accepted drafts plus the target's own), `missed` (times the loop gave
up a step's overlap to wait for a token in flight and then found no draft) and whether the
greedy texts are identical. These need a model with a tokenizer (the default: the embedded SmolLM2).

`--verify-cost` (also run alone with `--workloads none`, e.g. on the Llama-3-8B shape with
`--model minisgl/benchmark/models/llama-3-8b --load-format dummy`) times, for one request of
`--context` tokens, a plain decode step (CUDA graphs where the engine has them) against a verify
step of K drafts, the step a fully accepted draft would replace K + 1 decode steps with;
`--profile` prints each step's GPU kernels (time, count, share of the step's span).
`--skinny-max-rows 16` runs the verify step's linear layers (and LM head) through the skinny
tensor-core GEMM instead of cuBLAS (a verify step of K drafts is K + 1 rows, padded to the next
CUDA-graph size): run with and without it for an A/B.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

from minisgl.benchmark import common
from minisgl.benchmark.common import Row
from minisgl.core import Batch, Req, SamplingParams, TableWrite
from minisgl.llm import LLM

PASSAGE = '''def merge_intervals(intervals):
    """Merge overlapping intervals and return them sorted by start."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]


def total_covered(intervals):
    """The total length covered by the intervals, overlaps counted once."""
    return sum(end - start for start, end in merge_intervals(intervals))


def gaps(intervals, low, high):
    """The parts of [low, high) that no interval covers, in order."""
    result = []
    position = low
    for start, end in merge_intervals(intervals):
        if start > position:
            result.append((position, min(start, high)))
        position = max(position, end)
        if position >= high:
            break
    if position < high:
        result.append((position, high))
    return result
'''
COPY_TASK = (
    "Rewrite the following Python code, renaming the function merge_intervals to "
    "merge_ranges everywhere. Output only the code.\n\n"
)
CHAT_TOPICS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how bees make honey, for a curious ten-year-old.",
    "What are some good habits for learning a new language?",
    "Describe a walk through a busy market in the morning.",
    "Give me ideas for a weekend trip in the mountains.",
    "Why is the sky blue? Explain it simply.",
    "Write a poem about autumn leaves.",
    "What should I consider when adopting a dog?",
]


def chat_ids(llm: LLM, text: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": text}])


def run_pair(llm: LLM, prompts: list[list[int]], max_tokens: int, repeat: int) -> Row:
    """The same greedy requests with speculation off, then on, `repeat` times in turn; each
    mode's best time (a shared machine only ever slows a run down)."""
    sched = llm.scheduler
    policy = sched.spec
    assert policy is not None, "the engine needs its speculative config"
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    best = {"off": float("inf"), "on": float("inf")}
    # Process CPU time too: on a shared CPU host other processes stretch the wall time of
    # either run, much less the CPU time this one spends.
    best_cpu = dict(best)
    texts: dict[str, list[list[int]]] = {}

    def counts() -> tuple[int, int, int, int]:
        st = policy.stats
        return st.verify_rows, st.proposed, st.accepted, st.missed

    start_stats = counts()
    for _ in range(repeat):
        for mode, spec in (("off", None), ("on", policy)):
            sched.spec = spec  # None: no request speculates (the baseline, on the same engine)
            sched.flush_cache()  # no prefix reuse from the previous run
            start, start_cpu = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts, params, use_tqdm=False)
            best[mode] = min(best[mode], time.perf_counter() - start)
            best_cpu[mode] = min(best_cpu[mode], time.process_time() - start_cpu)
            texts[mode] = [o["token_ids"] for o in outs]
    sched.spec = policy
    rows, proposed, accepted, missed = (b - a for a, b in zip(start_stats, counts()))
    tokens, tokens_off = sum(len(t) for t in texts["on"]), sum(len(t) for t in texts["off"])
    return {
        "tokens": tokens,
        "tok_per_s_off": tokens_off / best["off"],
        "tok_per_s_on": tokens / best["on"],
        "speedup": best["off"] / best["on"] * tokens / max(1, tokens_off),
        "speedup_cpu_time": best_cpu["off"] / best_cpu["on"] * tokens / max(1, tokens_off),
        "mean_accepted_length": (accepted + rows) / rows if rows else 0.0,
        "acceptance": accepted / proposed if proposed else 0.0,
        "verify_rows": rows // repeat,
        # waits for a token in flight that then found no draft (each cost the overlap of a step)
        "missed": missed // repeat,
        "identical": texts["on"] == texts["off"],
    }


def workloads(llm: LLM, names: list[str], args: argparse.Namespace) -> list[Row]:
    rows = []
    for name in names:
        if name == "copy":
            prompts, n = [chat_ids(llm, COPY_TASK + PASSAGE)], args.copy_tokens
        elif name == "chat":
            prompts, n = [chat_ids(llm, CHAT_TOPICS[0])], args.chat_tokens
        elif name == "concurrent":
            topics = [CHAT_TOPICS[i % len(CHAT_TOPICS)] for i in range(args.concurrency)]
            prompts = [chat_ids(llm, f"({i}) {t}") for i, t in enumerate(topics)]
            n = args.chat_tokens
        else:
            raise SystemExit(f"unknown workload {name!r}: copy, chat, concurrent or none")
        llm.generate(prompts[:1], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
        row = {"workload": name, "requests": len(prompts), **run_pair(llm, prompts, n, args.repeat)}
        rows.append(row)
    return rows


def verify_cost(llm: LLM, context: int, k: int, iters: int, profile: bool = False) -> Row:
    """Median times of a decode step and of a verify step of `k` drafts, one request of
    `context` tokens (the same step rerun: its K/V rewritten in place); with `profile`, each
    step's GPU kernels (torch.profiler over `iters` more steps) printed as a table."""
    sched, engine = llm.scheduler, llm.engine
    vocab = min(10000, engine.model_config.vocab_size)
    prompt = [(7 * i + 3) % vocab for i in range(context)]
    req = Req("verify-cost", prompt, SamplingParams(max_tokens=k + 8, ignore_eos=True), seed=0)
    overlap, sched.overlap = sched.overlap, False  # the prefill's token on the host at once
    sched.add_request(req)
    sched.step()  # the prefill, and the first token
    sched.overlap = overlap
    assert req.output_ids and req.seq is not None
    sched.kv.grow(req, req.seq_len + k)
    pages, tokens, *_ = sched.kv.take_writes()
    p, n = req.seq_len - 1, req.num_sampled
    drafts = TableWrite(req.seq.slot, req.seq_len, [(5 * i + 1) % vocab for i in range(k)])
    decode = Batch([req.seq], [p], [1], [True], [n], tokens, pages)
    verify = Batch([req.seq], [p], [k + 1], [True], [n], [drafts], draft_lens=[k])
    times = {}
    for name, batch in (("decode", decode), ("verify", verify)):
        seen = []
        for i in range(iters + 3):
            common.synchronize(engine.device)
            start = time.perf_counter()
            engine.forward_batch(batch).wait()
            common.synchronize(engine.device)
            if i >= 3:
                seen.append(time.perf_counter() - start)
        times[name] = statistics.median(seen)
        if profile and engine.device.type == "cuda":

            def step(b: Batch = batch) -> None:
                engine.forward_batch(b).wait()

            common.profile_steps(step, iters, f"\n{name} step: ")
    sched.abort(req.rid)
    ratio = times["verify"] / times["decode"]
    return {
        "context": context,
        "k": k,
        "decode_ms": times["decode"] * 1e3,
        "verify_ms": times["verify"] * 1e3,
        "verify_over_decode": ratio,
        # A fully accepted draft: k + 1 tokens for one verify step (drafting not counted).
        "itl_over_decode_if_all_accepted": ratio / (k + 1),
        "cuda_graphs": engine.graphs is not None,
    }


def main(argv: Sequence[str] | None = None) -> None:
    p = common.engine_parser(__doc__, load_format="auto", speculative_algorithm="ngram")
    # The benchmark's short names of the speculative flags (the scripts' and docs' commands).
    for short in ("algorithm", "num-draft-tokens", "ngram-n", "ngram-min-n", "draft-layers",
                  "draft-model", "max-batch"):  # fmt: skip
        common.add_alias(p, f"--{short}", f"--speculative-{short}")
    p.add_argument("--workloads", default="copy,chat,concurrent",
                   help="comma-separated: copy, chat, concurrent; none for --verify-cost alone")  # fmt: skip
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--copy-tokens", type=int, default=320)
    p.add_argument("--chat-tokens", type=int, default=256,
                   help="chat and concurrent: output tokens per request (short runs are noisy)")  # fmt: skip
    p.add_argument("--repeat", type=int, default=3, help="runs of each mode (the best counts)")
    p.add_argument("--verify-cost", action="store_true", help="time a verify step (see above)")
    p.add_argument("--context", type=int, default=128, help="--verify-cost's context")
    p.add_argument("--iters", type=int, default=20, help="--verify-cost's timed steps")
    p.add_argument("--profile", action="store_true",
                   help="--verify-cost: also each step's GPU kernels (torch.profiler)")  # fmt: skip
    args = p.parse_args(argv)
    dummy = args.load_format == "dummy"
    llm = common.make_llm(args, **({"max_context_len": 4096} if dummy else {}))
    names = [w for w in args.workloads.split(",") if w and w != "none"]
    rows = workloads(llm, names, args)
    cost = (
        verify_cost(llm, args.context, args.speculative_num_draft_tokens, args.iters, args.profile)
        if args.verify_cost
        else None
    )
    algorithm, k = args.speculative_algorithm, args.speculative_num_draft_tokens
    info = {"model": args.model or "SmolLM2-135M-Instruct (embedded)", "algorithm": algorithm,
            "k": k, **common.device_info(llm.engine.device)}  # fmt: skip
    print(f"speculative decoding ({algorithm}, K = {k}) on {info['device']}")
    if rows:
        columns = ["workload", "requests", "tok_per_s_off", "tok_per_s_on", "speedup",
                   "speedup_cpu_time", "mean_accepted_length", "acceptance", "verify_rows",
                   "missed", "identical"]  # fmt: skip
        common.print_table("output tokens/s, speculation off and on", rows, columns)
    if cost is not None:
        common.print_table("verify step against a decode step", [cost], list(cost))
    common.emit_json({**info, "workloads": rows, "verify_cost": cost})


if __name__ == "__main__":
    main()
