"""`--deterministic` with the CUDA path's Triton kernels, run by Triton's CPU interpreter: the
attention backend (every step one `mixed_attention` of one split and one tile shape), the
batch-invariant GEMM of the linear layers and the fused norm, rotary and activation kernels.
Kept small: the interpreter runs every program of every launch in Python."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed (optional dependency 'gpu')")

from helpers import assert_kv_clean, checked_llm, force_fused_kernels, random_prompts  # noqa: E402

from minisgl import SamplingParams  # noqa: E402
from minisgl.kernels.gemv.invariant import InvariantGemmConfig, invariant_matmul  # noqa: E402

VOCAB = 384


@pytest.fixture(scope="module", autouse=True)
def _interpreted():
    if torch.cuda.is_available():
        pytest.skip("tests/gpu/test_deterministic_gpu.py covers this natively")
    from minisgl.kernels.attention.mixed import _mixed_kernel
    from minisgl.kernels.common import is_interpreted

    if not is_interpreted(_mixed_kernel):
        pytest.skip("minisgl.kernels was imported before TRITON_INTERPRET=1 was set")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_gemm_rows_do_not_depend_on_the_batch(dtype):
    """Small tiles and two K splits: each row has the same bits at any row count and offset,
    and the product's value."""
    cfg = InvariantGemmConfig(block_m=16, block_n=16, block_k=16, programs=8, min_split_blocks=1)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 72, generator=gen).to(dtype)
    x = torch.randn(37, 72, generator=gen).to(dtype)
    full = invariant_matmul(x, w, cfg)
    want = (x.float() @ w.float().t()).to(dtype)
    torch.testing.assert_close(full, want, atol=0.07 if dtype == torch.bfloat16 else 1e-4, rtol=0)
    for lo, n in [(0, 1), (5, 3), (17, 20), (36, 1)]:
        assert torch.equal(invariant_matmul(x[lo : lo + n], w, cfg), full[lo : lo + n])


def test_alone_equals_batched_chunked_speculative(tiny_model_dir, monkeypatch):
    """Two requests (greedy, seeded) alone, then among fillers with prefill chunks of 8
    tokens, page size 4 and n-gram speculation: the same bits."""
    force_fused_kernels(monkeypatch)
    a, b = random_prompts(2, VOCAB, seed=59, lo=10, hi=14)
    targets = [a, b[:4] * 4]
    params = [
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=True),
        SamplingParams(max_tokens=8, temperature=0.8, seed=9, ignore_eos=True, logprobs=True),
    ]
    options = dict(
        deterministic=True, attention_backend="triton", skip_warmup=True, page_size=4,
        speculative_ngram_min_n=2,
    )  # fmt: skip
    alone = checked_llm(tiny_model_dir("qwen3"), False, cache="naive", **options)
    want = [alone.generate([t], p, use_tqdm=False)[0] for t, p in zip(targets, params)]
    fillers = [targets[0][:5] + random_prompts(1, VOCAB, seed=52, lo=9, hi=10)[0], [7, 8, 9]]
    llm = checked_llm(
        tiny_model_dir("qwen3"), False, max_prefill_tokens=8, speculative_algorithm="ngram",
        **options,
    )  # fmt: skip
    other = SamplingParams(max_tokens=4, temperature=0.5, seed=1, ignore_eos=True)
    got = llm.generate(fillers[:1] + targets + fillers[1:], [other, *params, other], False)
    for w, g in zip(want, got[1:3], strict=True):
        assert (g["token_ids"], g["logprobs"]) == (w["token_ids"], w["logprobs"])
    assert llm.scheduler.spec is not None and llm.scheduler.spec.stats.verify_rows > 0
    assert_kv_clean(llm)
