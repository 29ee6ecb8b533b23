"""The on-device sampler: distributions on fixed logits, seeds, top-k=1 == greedy."""

from __future__ import annotations

import math

import pytest
import torch

from minisgl.engine.sampler import (
    LogitBias,
    SamplingInputs,
    StopMask,
    apply_token_mask,
    hashed_uniform,
    sample,
)
from minisgl.engine.step import TokenMask

N = 20000
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def _inputs(n: int, *, temperature=1.0, top_k=None, top_p=1.0, min_p=0.0) -> SamplingInputs:
    v = LOGITS.numel()
    return SamplingInputs(
        temperature=torch.full((n,), temperature),
        top_k=torch.full((n,), top_k or v, dtype=torch.int64),
        top_p=torch.full((n,), top_p),
        min_p=torch.full((n,), min_p),
        seeds=torch.arange(n, dtype=torch.int64) * 7919 + 11,
        steps=torch.zeros(n, dtype=torch.int64),
        all_greedy=temperature == 0,
        needs_sort=top_k is not None or top_p < 1.0,
        needs_min_p=min_p > 0,
        top_logprobs=0,
        want_logprobs=False,
    )


def _expected(temperature=1.0, top_k=None, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """The target distribution, written the obvious way (sorted, one filter at a time)."""
    p = torch.softmax(LOGITS.double() / temperature, dim=0)
    order = p.argsort(descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for rank, i in enumerate(order.tolist()):
        if (top_k is None or rank < top_k) and (rank == 0 or mass < top_p):
            keep[i] = True
        mass += float(p[i])
    keep &= p >= min_p * p.max()
    q = torch.where(keep, p, torch.zeros_like(p))
    return q / q.sum()


def _empirical(inp: SamplingInputs) -> torch.Tensor:
    tokens = sample(LOGITS.repeat(N, 1), inp).tokens
    return torch.bincount(tokens, minlength=LOGITS.numel()).double() / N


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 1.0},
        {"temperature": 0.5},
        {"temperature": 2.0},
        {"top_p": 0.7},
        {"top_k": 3},
        {"top_k": 5, "top_p": 0.9, "temperature": 1.3},
        {"min_p": 0.2},
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_samples_follow_the_filtered_distribution(kw):
    expected = _expected(**kw)
    got = _empirical(_inputs(N, **kw))
    sigma = torch.sqrt(expected * (1 - expected) / N)
    assert torch.all(got[expected == 0] == 0), "a filtered-out token was sampled"
    assert torch.all((got - expected).abs() <= 5 * sigma + 1e-9), (got, expected)


def test_greedy_and_top_k_1_pick_the_argmax():
    assert torch.all(sample(LOGITS.repeat(64, 1), _inputs(64, temperature=0)).tokens == 0)
    assert torch.all(sample(LOGITS.repeat(64, 1), _inputs(64, top_k=1)).tokens == 0)


def test_noise_depends_only_on_seed_and_step():
    seeds = torch.tensor([5, 6, 5, 5], dtype=torch.int64)
    steps = torch.tensor([0, 0, 0, 1], dtype=torch.int64)
    u = hashed_uniform(seeds, steps, 1000)
    assert torch.equal(u[0], u[2])
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[3])
    assert float(u.min()) > 0 and float(u.max()) < 1
    # Roughly uniform: mean and variance of 4000 draws.
    assert math.isclose(float(u.mean()), 0.5, abs_tol=0.02)
    assert math.isclose(float(u.var()), 1 / 12, abs_tol=0.01)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_logits_sample_like_their_fp32_upcast(dtype):
    """The engine hands the sampler the model's logits as they are: every path (greedy, the
    filtered torch path, log-probs) gives what the fp32 upcast of them gives."""
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(16, 300, generator=gen) * 3).to(dtype)
    for kw in ({"temperature": 0}, {"temperature": 0.8}, {"top_k": 20, "top_p": 0.9}):
        inp = _inputs(16, **kw)
        inp.want_logprobs, inp.top_logprobs = True, 3
        got, want = sample(logits, inp), sample(logits.float(), inp)
        assert torch.equal(got.tokens, want.tokens)
        for g, w in zip(
            (got.logprobs, got.top_ids, got.top_logprobs),
            (want.logprobs, want.top_ids, want.top_logprobs),
        ):
            assert g is not None and w is not None and torch.equal(g, w)


def test_stop_mask_keeps_pending_rows_from_their_stop_ids():
    """min_tokens: rows still short of it cannot sample their stop ids; other rows and the
    log-probs (of the raw logits) are untouched; ids beyond the vocabulary are left out."""
    v = LOGITS.numel()
    pending, stop_ids = [True, False, True, True], [{0, 1}, {0}, {0, 99}, set()]
    mask = StopMask.build(pending, stop_ids, v, torch.device("cpu"))
    assert mask is not None and sorted(zip(mask.rows.tolist(), mask.ids.tolist())) == [
        (0, 0),
        (0, 1),
        (2, 0),
    ]
    assert StopMask.build([False, True], [{0}, set()], v, torch.device("cpu")) is None
    inp = _inputs(4, temperature=0)
    inp.stop_mask, inp.want_logprobs = mask, True
    out = sample(LOGITS.repeat(4, 1), inp)
    assert out.tokens.tolist() == [2, 0, 1, 0]  # the best token not masked
    assert out.logprobs is not None
    raw = torch.log_softmax(LOGITS, dim=0)
    assert torch.allclose(out.logprobs, raw[out.tokens])


def test_stop_mask_samples_the_rest_of_the_distribution():
    inp = _inputs(N)
    inp.stop_mask = StopMask.build([True] * N, [{0, 3}] * N, LOGITS.numel(), torch.device("cpu"))
    got = _empirical(inp)
    expected = torch.softmax(LOGITS.double(), dim=0)
    expected[[0, 3]] = 0
    expected /= expected.sum()
    sigma = torch.sqrt(expected * (1 - expected) / N)
    assert got[0] == 0 and got[3] == 0
    assert torch.all((got - expected).abs() <= 5 * sigma + 1e-9), (got, expected)


def test_logit_bias_moves_the_rows_that_have_one():
    """OpenAI's logit_bias: added to the row's logits before sampling; -100 forbids a token in
    practice, +100 forces it; other rows and the log-probs (of the raw logits) are untouched;
    ids beyond the vocabulary (refused at the API) are left out."""
    v, cpu = LOGITS.numel(), torch.device("cpu")
    biases = [[(0, -100.0)], [], [(6, 100.0), (99, 5.0)], [(0, -1.0), (1, 0.75)]]
    bias = LogitBias.build(biases, v, cpu)
    assert bias is not None
    triples = zip(bias.rows.tolist(), bias.ids.tolist(), bias.values.tolist())
    assert sorted(triples) == [(0, 0, -100.0), (2, 6, 100.0), (3, 0, -1.0), (3, 1, 0.75)]
    assert LogitBias.build([[], [(99, 1.0)]], v, cpu) is None
    inp = _inputs(4, temperature=0)
    inp.logit_bias, inp.want_logprobs = bias, True
    out = sample(LOGITS.repeat(4, 1), inp)
    # Row 3: logits 1.0 and 2.25 for tokens 0 and 1 now; token 1 wins.
    assert out.tokens.tolist() == [1, 0, 6, 1]
    assert out.logprobs is not None
    assert torch.allclose(out.logprobs, torch.log_softmax(LOGITS, dim=0)[out.tokens])


def test_logit_bias_samples_the_shifted_distribution():
    inp = _inputs(N)
    inp.logit_bias = LogitBias.build(
        [[(7, 3.0), (0, -2.0)]] * N, LOGITS.numel(), torch.device("cpu")
    )
    got = _empirical(inp)
    shifted = LOGITS.clone()
    shifted[7] += 3.0
    shifted[0] -= 2.0
    expected = torch.softmax(shifted.double(), dim=0)
    sigma = torch.sqrt(expected * (1 - expected) / N)
    assert torch.all((got - expected).abs() <= 5 * sigma + 1e-9), (got, expected)


def test_logit_bias_cannot_lift_a_token_the_grammar_forbids():
    v, cpu = LOGITS.numel(), torch.device("cpu")
    bits = torch.tensor([[0b0000_0110], [-1]], dtype=torch.int32)  # row 0: tokens 1, 2 only
    inp = _inputs(2, temperature=0)
    inp.token_mask = TokenMask(bits, [0])
    inp.logit_bias = LogitBias.build([[(7, 100.0)], [(7, 100.0)]], v, cpu)
    assert sample(LOGITS.repeat(2, 1), inp).tokens.tolist() == [1, 7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4], [1, 3, 4]])
def test_token_mask_bans_exactly_the_clear_bits_of_the_constrained_rows(dtype, rows):
    gen = torch.Generator().manual_seed(3)
    words, vocab = 4, 100  # a mask wider than the vocabulary (its tail bits are ignored)
    bits = torch.randint(-(2**31), 2**31 - 1, (5, words), dtype=torch.int32, generator=gen)
    bits[1] = 0  # nothing allowed
    bits[3] = -1  # everything allowed
    logits = torch.randn(5, vocab, generator=gen).to(dtype)
    got = apply_token_mask(logits.clone(), TokenMask(bits, rows))
    for r in range(5):
        for t in range(vocab):
            allowed = r not in rows or (int(bits[r, t // 32]) >> (t % 32)) & 1
            want = logits[r, t] if allowed else float("-inf")
            assert got[r, t] == want, (r, t)


def test_token_mask_narrower_than_the_logits_leaves_the_tokens_past_it():
    logits = torch.randn(2, 50)
    bits = torch.tensor([[0b101], [0]], dtype=torch.int32)  # row 0: tokens 0 and 2 of 0..31
    got = apply_token_mask(logits.clone(), TokenMask(bits, [0]))
    banned = [t for t in range(32) if t not in (0, 2)]
    assert torch.isinf(got[0, banned]).all() and torch.equal(got[0, [0, 2]], logits[0, [0, 2]])
    assert torch.equal(got[0, 32:], logits[0, 32:]) and torch.equal(got[1], logits[1])
