"""Speculative sampling keeps the target's distribution: a chi-square test over the drafted
positions (2..K+1; the first token comes from the prefill and proves nothing), for the n-gram
proposer and the layer-skip draft, good drafts and a bad one; and the same test rejects a
deliberately wrong acceptance rule.

The target's conditional distribution at each sampled position is computed by transformers on
the sampled sequence; each sample falls in the bin of its rank under that distribution (top-k
keeps K_TOP tokens), and the expected count of a bin is the sum of its probabilities."""

from __future__ import annotations

import pytest
import torch
from helpers import load_hf, random_prompts

from minisgl import LLM, SamplingParams
from minisgl.engine import speculative
from minisgl.spec.verify import Verdict

TEMPERATURE = 0.25
TOP_K = 4  # a small support, so that every bin of the test is well filled
K = 4  # drafts per verify step
NUM_REQS = 160
ALPHA = 1e-3


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's statistic over [rows, bins] -> its p-value (degrees of freedom: each row's
    bins less one)."""
    stat = ((observed - expected) ** 2 / expected).sum()
    df = observed.numel() - observed.shape[0]
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2.0))


def target_probs(logits: torch.Tensor) -> torch.Tensor:
    """logits [V] -> the distribution the sampler draws from (temperature, then top-k)."""
    p = torch.softmax(logits.double() / TEMPERATURE, dim=-1)
    cut = p.topk(TOP_K).values[-1]
    p = torch.where(p >= cut, p, 0.0)
    return p / p.sum()


def drafted_positions_p(llm: LLM, hf, prompts: list[list[int]]) -> float:
    """Sample K + 1 tokens per prompt (one seed each) and test the tokens at positions
    2..K+1 against the target's conditionals."""
    params = [
        SamplingParams(
            max_tokens=K + 1, temperature=TEMPERATURE, top_k=TOP_K, seed=i, ignore_eos=True
        )
        for i in range(len(prompts))
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    observed = torch.zeros(K, TOP_K, dtype=torch.float64)
    expected = torch.zeros(K, TOP_K, dtype=torch.float64)
    for prompt, out in zip(prompts, outs):
        ids = prompt + out["token_ids"]
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0]  # row j scores token j + 1
        for pos in range(1, K + 1):
            probs = target_probs(logits[len(prompt) - 1 + pos])
            top_p, top_ids = probs.topk(TOP_K)
            rank = (top_ids == out["token_ids"][pos]).nonzero()
            assert rank.numel() == 1, "a token outside the top-k support was sampled"
            observed[pos - 1, int(rank[0, 0])] += 1
            expected[pos - 1] += top_p
    return chi_square_p(observed, expected)


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="module")
def hf(model_path):
    return load_hf(model_path)


def _llm(path, algo: str, **kw) -> LLM:
    return LLM(
        str(path),
        dtype="float32",
        device="cpu",
        skip_warmup=True,
        speculative_algorithm=algo,
        speculative_num_draft_tokens=K,
        speculative_max_batch=NUM_REQS,
        **kw,
    )


def _prompts(seed: int) -> list[list[int]]:
    return random_prompts(NUM_REQS, 384, seed=seed, lo=6, hi=14)


def _copy_prompts(llm: LLM, seed: int) -> list[list[int]]:
    """Prompts P + G + P, G the model's greedy continuation of P: the n-gram proposer drafts
    G again after P."""
    base = random_prompts(NUM_REQS // 4, 384, seed=seed, lo=6, hi=10)
    greedy = SamplingParams(max_tokens=K + 2, temperature=0, ignore_eos=True)
    conts = [o["token_ids"] for o in llm.generate(base, greedy, use_tqdm=False)]
    return [p + g + p for p, g in zip(base, conts)] * 4


def _check(llm: LLM, hf, prompts: list[list[int]], min_accept: float) -> None:
    p = drafted_positions_p(llm, hf, prompts)
    stats = llm.scheduler.spec.stats
    assert stats.proposed > NUM_REQS, stats  # the proposer drafted
    assert stats.accepted >= min_accept * stats.proposed, stats  # acceptances were tested
    assert p > ALPHA, (p, stats)


@pytest.mark.slow
def test_full_depth_draft_keeps_the_distribution(model_path, hf) -> None:
    """A layer-skip draft of every layer proposes the target's greedy tokens: good drafts."""
    _check(_llm(model_path, "draft", speculative_draft_layers=2), hf, _prompts(1), 0.2)


@pytest.mark.slow
def test_one_layer_draft_keeps_the_distribution(model_path, hf) -> None:
    """One layer of two: a bad draft, mostly rejected (the residual distribution decides)."""
    _check(_llm(model_path, "draft", speculative_draft_layers=1), hf, _prompts(2), 0.0)


@pytest.mark.slow
def test_ngram_drafts_keep_the_distribution(model_path, hf) -> None:
    llm = _llm(model_path, "ngram", speculative_ngram_min_n=1)
    _check(llm, hf, _copy_prompts(llm, seed=3), 0.05)


def _no_residual(probs, draft, has_draft, uniforms) -> Verdict:
    """A wrong rule: accept with probability p(d) but on rejection sample from p itself
    (the draft may be drawn again), which favours drafted tokens."""
    d = draft.clamp(min=0).unsqueeze(1)
    accept = has_draft & (uniforms.gather(1, d).squeeze(1) < probs.gather(1, d).squeeze(1))
    return Verdict(accept, (probs / -torch.log(uniforms)).argmax(dim=-1))


@pytest.mark.slow
def test_a_wrong_acceptance_rule_is_rejected(model_path, hf, monkeypatch) -> None:
    monkeypatch.setattr(speculative, "rejection_sample", _no_residual)
    llm = _llm(model_path, "draft", speculative_draft_layers=2)
    p = drafted_positions_p(llm, hf, _prompts(1))
    assert p < ALPHA, p
