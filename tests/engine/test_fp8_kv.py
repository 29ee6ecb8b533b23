"""An FP8 (e4m3) KV cache through the torch backend (the CPU path): log-probs of tiny models
against the same engine with an fp32 cache, the prefix cache, chunked prefill and retraction on
quantized pages, calibration and checkpoint scales, and the pool's capacity.

The tolerance. e4m3 keeps 3 mantissa bits, so every stored K and V value is off by at most
2^-4 of itself, in either direction. The test measures what such an error can do to the
log-probs on the same model and prompt: it scales every K and V value by (1 + 2^-4), then by
(1 - 2^-4), all in the same direction (through the K/V projection weights, or Qwen3's k-norm
weight), and takes the smaller of the two largest log-prob changes as the tolerance. Rounding
errors of varying sign and size partly cancel in the dot products and weighted sums of
attention, so the FP8 cache must stay within that coherent worst-direction change (on these
models it stays at about a third of it) and must differ from fp32 at all (it really quantizes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_kv_clean, prefill_logits, random_prompts, save_tiny_model

from minisgl import LLM, SamplingParams
from minisgl.kernels.fp8 import FP8_MAX, FP8_REL_ERR

VOCAB = 384
FP8 = {"kv_cache_dtype": "fp8_e4m3"}
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def make(path: Path, **options: Any) -> LLM:
    options = {"num_pages": 1024, "skip_warmup": True, **options}
    return LLM(str(path), dtype="float32", device="cpu", **options)


def scale_kv(llm: LLM, factor: float) -> None:
    """Every K and V value of every layer times `factor`, through the weights that make them."""
    with torch.no_grad():
        for layer in llm.engine.model.model.layers:
            attn = layer.self_attn
            q, k, _ = attn.qkv_proj.sizes
            if attn.k_norm is not None:  # the norm would undo a scaled projection
                attn.k_norm.weight.mul_(factor)
            else:
                attn.qkv_proj.weight[q : q + k].mul_(factor)
            attn.qkv_proj.weight[q + k :].mul_(factor)


def log_probs(llm: LLM, ids: list[int]) -> torch.Tensor:
    return prefill_logits(llm, ids).log_softmax(-1)


def e4m3_tolerance(path: Path, ids: list[int], ref: torch.Tensor) -> float:
    """The smaller of the largest log-prob changes that a coherent (1 +- 2^-4) scaling of every
    K and V value causes (see the module docstring)."""
    changes = []
    for sign in (1, -1):
        llm = make(path)
        scale_kv(llm, 1 + sign * FP8_REL_ERR)
        changes.append((log_probs(llm, ids) - ref).abs().max().item())
    return min(changes)


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
@pytest.mark.parametrize("calibrate", [0, 256], ids=["scale1", "calibrated"])
def test_fp8_kv_log_probs_within_the_e4m3_tolerance(tiny_model_dir, arch, calibrate):
    path = tiny_model_dir(arch)
    ids = random_prompts(1, VOCAB, seed=3, lo=150, hi=151)[0]
    ref = log_probs(make(path), ids)
    tol = e4m3_tolerance(path, ids, ref)
    fp8 = make(path, **FP8, kv_cache_calibrate=calibrate)
    assert fp8.engine.pool.dtype == torch.float8_e4m3fn
    err = (log_probs(fp8, ids) - ref).abs().max().item()
    assert 0 < err <= tol, (err, tol)

    # Decoding reads the quantized cache too: greedy steps agree with fp32 to the same
    # tolerance, token for token, until the fp32 run's two best tokens were within twice the
    # tolerance of each other (each may move by it, so either may win there).
    params = SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    want = make(path).generate([ids[:40]], params, use_tqdm=False)[0]
    got = fp8.generate([ids[:40]], params, use_tqdm=False)[0]
    steps = zip(want["token_ids"], got["token_ids"], want["logprobs"], got["logprobs"],
                want["top_logprobs"])  # fmt: skip
    for a, b, lp_a, lp_b, top in steps:
        if a != b:
            assert top[0][1] - top[1][1] <= 2 * tol
            break
        assert abs(lp_a - lp_b) <= tol
    assert_kv_clean(fp8)


def test_fp8_pool_holds_twice_the_tokens_of_bf16_in_the_same_memory(tiny_model_dir):
    path = tiny_model_dir("llama3")
    budget = {"num_pages": 0, "cpu_kv_gib": 0.01, "max_running_requests": 256}
    bf16 = make(path, kv_cache_dtype="bfloat16", **budget).engine
    fp8 = make(path, **FP8, **budget).engine
    assert fp8.pool.dtype == torch.float8_e4m3fn and bf16.pool.dtype == torch.bfloat16
    # The pools keep one spare page each; the budget splits into whole pages.
    assert fp8.num_pages + 1 in (2 * (bf16.num_pages + 1), 2 * (bf16.num_pages + 1) + 1)
    nbytes = [e.pool.k(0).nbytes * 2 * e.pool.num_layers for e in (bf16, fp8)]
    assert abs(nbytes[0] - nbytes[1]) <= 2 * nbytes[1] / fp8.pool.num_pages  # within a page


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir) -> Path:
    return tiny_model_dir("qwen3")


def shared_prefix_prompts() -> list[list[int]]:
    base = random_prompts(1, VOCAB, seed=11, lo=70, hi=71)[0]
    tails = random_prompts(6, VOCAB, seed=12, lo=1, hi=30)
    return [base[:n] + t for n, t in zip([5, 17, 33, 48, 64, 70], tails)] + [base[:40], base]


def tokens(outs: list[dict]) -> list[list[int]]:
    return [o["token_ids"] for o in outs]


def test_fp8_kv_radix_cache_gives_the_naive_answers(qwen3):
    prompts = shared_prefix_prompts()
    outs = {}
    for cache in ("radix", "naive"):
        llm = make(qwen3, **FP8, cache=cache, page_size=4)
        # Twice: the second round reads the first round's quantized pages from the radix cache.
        outs[cache] = [o for _ in range(2) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert_kv_clean(llm)
    assert tokens(outs["radix"]) == tokens(outs["naive"])
    assert sum(o["cached_tokens"] for o in outs["radix"]) > 0


def test_fp8_kv_chunked_prefill_and_retraction_give_the_same_answers(qwen3):
    prompts = random_prompts(10, VOCAB, seed=21, lo=20, hi=40)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    whole = make(qwen3, **FP8).generate(prompts, params, use_tqdm=False)
    chunked = make(qwen3, **FP8, max_prefill_tokens=7).generate(prompts, params, use_tqdm=False)
    assert tokens(chunked) == tokens(whole)
    small = make(qwen3, **FP8, num_pages=40, page_size=4, max_prefill_tokens=64)
    retracted = small.generate(prompts, params, use_tqdm=False)
    assert small.scheduler.stats["retractions"] > 0, "the small pool should retract"
    assert tokens(retracted) == tokens(whole)
    assert_kv_clean(small)


def test_calibration_shifts_keys_by_their_mean_and_scales_twice_the_largest_over_448(qwen3):
    """Against transformers: K (after q/k-norm and RoPE) and V of the same tokens, read from
    its KV cache. The key shift is the keys' mean per (layer, head, channel); the scales map
    twice the largest |K - shift| and |V| of each head to 448."""
    from helpers import load_hf

    from minisgl.engine.kv_calibration import calibration_ids

    n = 200
    llm = make(qwen3, **FP8, kv_cache_calibrate=n)
    pool = llm.engine.pool
    ids = calibration_ids(None, VOCAB, n)  # the tiny model has no tokenizer: the text's bytes
    with torch.no_grad():
        cache = load_hf(qwen3)(torch.tensor([ids]), use_cache=True).past_key_values
    for layer in range(pool.num_layers):
        k, v = cache.layers[layer].keys[0], cache.layers[layer].values[0]  # [Hkv, T, D]
        shift = k.mean(dim=1)  # [Hkv, D]
        torch.testing.assert_close(pool.all_k_shifts()[layer], shift, rtol=1e-4, atol=1e-5)
        k_off = (k - shift[:, None]).abs().amax(dim=(1, 2))
        want = torch.stack([k_off, v.abs().amax(dim=(1, 2))]) * 2 / FP8_MAX
        torch.testing.assert_close(pool.all_scales()[:, layer], want, rtol=1e-4, atol=0)


def test_the_key_shift_leaves_attention_unchanged(qwen3):
    """Attention over keys minus a per-(head, channel) constant is the same attention: every
    score of a query moves by the same amount. An fp32 reference check of the invariance the
    FP8 pool relies on (the torch backend's attention, fp32 pool, shifted keys)."""
    from minisgl.kernels.attention import reference as ref

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(30, h, 16, generator=gen) for h in (4, 2, 2))
    shift = torch.randn(2, 16, generator=gen) * 5
    pos = torch.arange(30)
    torch.testing.assert_close(
        ref.attend_ref(q, k - shift, v, pos, 0.25), ref.attend_ref(q, k, v, pos, 0.25),
        atol=1e-5, rtol=1e-5,
    )  # fmt: skip


def test_checkpoint_kv_scales_reach_the_pool(tmp_path):
    from safetensors.torch import save_file

    path = save_tiny_model("llama3", tmp_path / "model")
    scales = {}
    for layer in range(2):
        prefix = f"model.layers.{layer}.self_attn"
        scales[f"{prefix}.k_scale"] = torch.tensor(0.5 + layer)
        scales[f"{prefix}.v_scale"] = torch.tensor(0.25 * (layer + 1))
    save_file(scales, str(path / "kv_scales.safetensors"))
    pool = make(path, **FP8).engine.pool
    want = torch.tensor([[[0.5, 0.5], [1.5, 1.5]], [[0.25, 0.25], [0.5, 0.5]]])
    assert torch.equal(pool.all_scales(), want)
    # A 16-bit cache ignores them; calibration overrides them.
    make(path)
    calibrated = make(path, **FP8, kv_cache_calibrate=64).engine.pool.all_scales()
    assert not torch.equal(calibrated, want)


def test_fp8_kv_options_are_checked():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="only an fp8_e4m3 KV cache"):
        LLM(kv_cache_calibrate=16)


def test_accuracy_scorer_is_the_engine_path(tiny_model_dir):
    """`benchmark.accuracy.text_log_probs` (one prefill over a pool of its own): the baseline
    equals transformers' log-probs; with an FP8 KV cache it equals the engine's own prefill
    through its pool (the same e4m3 K/V), and differs from the baseline."""
    from helpers import load_hf

    from minisgl.benchmark.accuracy import compare, text_log_probs

    path = tiny_model_dir("llama3")
    ids = random_prompts(1, VOCAB, seed=8, lo=120, hi=121)[0]
    base = text_log_probs(make(path), ids)
    with torch.no_grad():
        hf = load_hf(path)(torch.tensor([ids])).logits[0].log_softmax(-1)
    torch.testing.assert_close(base, hf, atol=1e-4, rtol=0)
    fp8 = make(path, **FP8, kv_cache_calibrate=64)
    got = text_log_probs(fp8, ids)
    torch.testing.assert_close(got, log_probs(fp8, ids), atol=1e-5, rtol=0)
    row = compare(base, got, ids)
    assert row["mean_kl"] > 0 and 0.5 < row["top1_agreement"] <= 1
    assert compare(base, base, ids)["mean_kl"] == 0
