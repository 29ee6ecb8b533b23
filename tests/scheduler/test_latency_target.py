"""The inter-token latency target through the real scheduler and a tiny model, with a fixed
step-time model standing in for the measured one: while requests decode, no planned step is
predicted past the target and a long prompt is chunked at page boundaries that the radix cache
takes whole; a prompt alone prefills at full size; outputs are those of the old policy."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import FixedStepModel, assert_kv_clean, random_prompts, record_steps

from minisgl import LLM, SamplingParams
from minisgl.core import Batch, Req
from minisgl.scheduler.step_time import StepShape

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PAGE, BUDGET, TARGET_MS = 4, 64, 5.0
# A prompt token costs 60 us: beside a few decodes a 5 ms step has room for ~30 of them.
MODEL = FixedStepModel(base=2e-3, mixed=1e-3, per_row=10e-6, per_token=60e-6, per_kv=1e-8)


@pytest.fixture(scope="module")
def model_path(tiny_model_dir: Any) -> Any:
    return tiny_model_dir("qwen3")


def make_llm(path: Any, target_ms: float | str) -> LLM:
    llm = LLM(str(path), dtype="float32", device="cpu", page_size=PAGE,
              max_prefill_tokens=BUDGET, itl_target_ms=target_ms)  # fmt: skip
    llm.scheduler.step_model = MODEL
    return llm


def decodes_then_a_long_prompt(
    llm: LLM, long: list[int], aligned: bool = True
) -> tuple[list[tuple[list[Req], Batch]], Req]:
    """Six short prompts start decoding, then a long one arrives; stepped to the end. Every
    step's requests and plan, and the long request (with `aligned`, checked after each of its
    chunks)."""
    sched = llm.scheduler
    steps = record_steps(sched)
    for i, p in enumerate(random_prompts(6, 384, seed=3, lo=2, hi=4)):
        sched.add_request(Req(rid=str(i), prompt_ids=p, params=GREEDY, seed=0))
    sched.step()
    late = Req(rid="long", prompt_ids=long, params=GREEDY, seed=0)
    sched.add_request(late)
    while sched.has_work:
        sched.step()
        sched.check_invariants()
        if aligned and 0 < late.num_computed < late.prompt_len:
            # Every chunk ends on a page boundary: all of it is in the radix cache already.
            assert late.num_computed % PAGE == 0 and late.cache_len == late.num_computed
    assert_kv_clean(llm)
    return steps, late


def test_steps_beside_decodes_stay_within_the_target(model_path: Any) -> None:
    long = random_prompts(1, 384, seed=4, lo=150, hi=151)[0]
    llm = make_llm(model_path, TARGET_MS)
    steps, late = decodes_then_a_long_prompt(llm, long)
    chunks = 0
    for reqs, batch in steps:
        shape = StepShape.of(batch)
        decoding = any(p >= r.prompt_len for r, p in zip(reqs, batch.prefix_lens))
        if decoding and shape.mixed:
            assert MODEL.predict(shape) <= TARGET_MS / 1e3, (batch.prefix_lens, batch.extend_lens)
            chunks += any(r is late for r in reqs)
    assert chunks >= 4  # the long prompt went in small chunks beside the decodes
    # The old policy (target off) fills the step and would have gone past the target.
    old = make_llm(model_path, 0)
    old_steps, old_late = decodes_then_a_long_prompt(old, long, aligned=False)
    first = next(b for reqs, b in old_steps if any(r is old_late for r in reqs))
    assert MODEL.predict(StepShape.of(first)) > TARGET_MS / 1e3
    # Same greedy tokens either way (and as each request alone).
    new_out = {r.rid: r.output_ids for reqs, _ in steps for r in reqs}
    old_out = {r.rid: r.output_ids for reqs, _ in old_steps for r in reqs}
    assert new_out == old_out
    alone = old.generate([long], GREEDY, use_tqdm=False)[0]["token_ids"]
    assert new_out["long"] == alone


def test_auto_target_is_a_multiple_of_the_decode_step(model_path: Any) -> None:
    llm = make_llm(model_path, "auto")
    long = random_prompts(1, 384, seed=5, lo=90, hi=91)[0]
    steps, late = decodes_then_a_long_prompt(llm, long)
    chunks = 0
    for reqs, batch in steps:
        rows = list(zip(reqs, batch.prefix_lens))
        decoding = [p + 1 for r, p in rows if p >= r.prompt_len]  # their KV reads
        if decoding and StepShape.of(batch).mixed:
            alone = StepShape(len(decoding), 0, sum(decoding), False)  # the decode step
            assert MODEL.predict(StepShape.of(batch)) <= 2.5 * MODEL.predict(alone)
            chunks += any(r is late for r in reqs)
    assert chunks >= 3


def test_a_prompt_alone_prefills_at_full_size(model_path: Any) -> None:
    llm = make_llm(model_path, TARGET_MS)
    steps = record_steps(llm.scheduler)
    prompt = random_prompts(1, 384, seed=6, lo=150, hi=151)[0]
    llm.generate([prompt], GREEDY, use_tqdm=False)
    assert [b.extend_lens for _, b in steps[:3]] == [[BUDGET], [BUDGET], [150 - 2 * BUDGET]]
