"""Tiny random models of each Llama-family architecture against transformers (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    TINY_ARCHS,
    assert_kv_clean,
    hf_greedy,
    load_hf,
    prefill_logits,
    random_prompts,
)

from minisgl import LLM, SamplingParams

NUM_TOKENS = 32


@pytest.fixture(scope="module", params=TINY_ARCHS)
def arch_setup(request, tiny_model_dir):
    path = tiny_model_dir(request.param)
    hf = load_hf(path)
    prompts = random_prompts(9, hf.config.vocab_size, seed=hash(request.param) % 1000)
    expected = [hf_greedy(hf, p, NUM_TOKENS) for p in prompts]
    return request.param, path, hf, prompts, expected


def test_prefill_logits_match_transformers(arch_setup):
    arch, path, hf, prompts, _ = arch_setup
    llm = LLM(str(path), dtype="float32", device="cpu", cache="naive")
    for ids in prompts[:4]:
        ours = prefill_logits(llm, ids)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        assert ours.shape == ref.shape
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert_kv_clean(llm)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_prefill_tokens": 7},  # forces chunked prefill
        {"num_pages": 96, "page_size": 4, "max_prefill_tokens": 64},  # queueing + retraction
        {"page_size": 16, "cache": "radix"},
    ],
    ids=["plain", "chunked", "small-pool", "page16"],
)
def test_batched_greedy_equals_transformers(arch_setup, options):
    arch, path, _, prompts, expected = arch_setup
    llm = LLM(str(path), dtype="float32", device="cpu", **options)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, exp in zip(outs, expected):
        assert out["token_ids"] == exp
        assert out["finish_reason"] == "length"
    if "num_pages" in options:
        assert llm.scheduler.stats["retractions"] > 0, "the small pool should force retraction"
    assert_kv_clean(llm)
