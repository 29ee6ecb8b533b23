"""A step's token budget: decodes and prefill chunks together fill `max_prefill_tokens`, so
steps that prefill have one token count while prompts wait (one GEMM shape for cuBLAS); prefill
keeps at least a quarter of the budget however many requests decode. (The latency target is
off here, as with `--itl-target-ms 0`: it is tested in test_latency_target.py.)"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import assert_kv_clean, random_prompts, record_steps

from minisgl import LLM, SamplingParams
from minisgl.core import Batch, Req

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return tiny_model_dir("qwen3")


Steps = list[tuple[list[Req], Batch]]


def run_steps(path: Any, budget: int, prompts: list[list[int]]) -> tuple[Steps, LLM]:
    """`prompts` added at once and stepped to the end; every step's requests and plan."""
    llm = LLM(str(path), dtype="float32", device="cpu", max_prefill_tokens=budget, itl_target_ms=0)
    sched = llm.scheduler
    batches = record_steps(sched)
    for i, p in enumerate(prompts):
        sched.add_request(Req(rid=str(i), prompt_ids=p, params=GREEDY, seed=0))
    while sched.has_work:
        sched.step()
        sched.check_invariants()
    assert_kv_clean(llm)
    return batches, llm


def test_decodes_and_chunks_fill_the_budget(model_path):
    # Six short prompts start decoding while a long one is prefilled in chunks beside them.
    short = random_prompts(6, 384, seed=3, lo=2, hi=4)
    long = random_prompts(1, 384, seed=4, lo=120, hi=121)
    budget = 16
    batches, llm = run_steps(model_path, budget, short + long)
    long_rows = 0
    for reqs, b in batches:
        rows = list(zip(reqs, b.prefix_lens, b.extend_lens))
        decodes = sum(1 for r, p, _ in rows if p >= r.prompt_len)
        unfinished = [r for r, p, e in rows if p + e < r.prompt_len]  # no retraction here
        assert b.num_tokens <= budget
        if unfinished:  # a prompt waits for the next step: the budget bounded this one
            assert b.num_tokens == budget, (b.prefix_lens, b.extend_lens)
        if any(r.rid == "6" for r in reqs) and decodes:
            long_rows += 1
    assert long_rows >= 3  # the long prompt's chunks did run beside decodes
    # The same outputs as one request at a time (each through its own steps).
    ref_llm = LLM(str(model_path), dtype="float32", device="cpu", max_prefill_tokens=budget)
    for i, p in enumerate(short + long):
        ref = ref_llm.generate([p], GREEDY, use_tqdm=False)[0]["token_ids"]
        got = next(r for reqs, _ in batches for r in reqs if r.rid == str(i)).output_ids
        assert got == ref


def test_prefill_keeps_a_quarter_of_the_budget(model_path):
    # Seven decoding requests and a budget of 8: the long prompt still gets 2 tokens a step.
    short = random_prompts(7, 384, seed=5, lo=2, hi=3)
    long = random_prompts(1, 384, seed=6, lo=40, hi=41)
    batches, llm = run_steps(model_path, 8, short + long)
    assert llm.scheduler.prefill_budget(7) == 2 and llm.scheduler.prefill_budget(3) == 5
    chunks = [
        e
        for reqs, b in batches
        for r, p, e in zip(reqs, b.prefix_lens, b.extend_lens)
        if r.rid == "7" and p + e < r.prompt_len and len(reqs) == 8
    ]
    assert chunks and set(chunks) == {2}
