"""Batch-1 decode steps through the layers' one-row GEMV path (`DecoderLayer.forward_one_row`:
fused norm / residual / SiLU GEMVs, taken on CUDA) against the layers' torch path, through the
whole engine. Here the fused kernels are switched on for CPU tensors and run in Triton's
interpreter; the GPU suite runs the same comparison natively."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed (optional dependency 'gpu')")

from helpers import assert_kv_clean, force_fused_kernels, random_prompts  # noqa: E402
from test_qwen3_moe import save_tiny  # noqa: E402

from minisgl import LLM, SamplingParams  # noqa: E402
from minisgl.models.llama import DecoderLayer  # noqa: E402

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=True)


@pytest.fixture(autouse=True)
def _interpreted():
    if torch.cuda.is_available():
        pytest.skip("tests/gpu/test_engine_gpu.py covers the path natively")
    from minisgl.kernels.common import is_interpreted
    from minisgl.kernels.gemv.gemv import _gemv_kernel

    if not is_interpreted(_gemv_kernel):
        pytest.skip("minisgl.kernels was imported before TRITON_INTERPRET=1 was set")


def _generate(path: str, prompts: list[list[int]], **kw) -> list[dict]:
    llm = LLM(path, dtype="float32", device="cpu", skip_warmup=True, **kw)
    out = [llm.generate([p], PARAMS, use_tqdm=False)[0] for p in prompts]  # one at a time
    assert_kv_clean(llm)
    return out


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3", "smollm2", "qwen3_moe"])
def test_one_row_steps_match_the_layers(arch, tiny_model_dir, tmp_path, monkeypatch):
    if arch == "qwen3_moe":
        save_tiny(tmp_path, seed=4)
        path = str(tmp_path)
    else:
        path = str(tiny_model_dir(arch))
    prompts = random_prompts(3, 256, seed=5, lo=2, hi=20)  # both vocabularies hold 256
    want = _generate(path, prompts, attention_backend="torch")

    force_fused_kernels(monkeypatch)
    calls = []
    one_row = DecoderLayer.forward_one_row

    def counting(self, *args, **kwargs):
        calls.append(1)
        return one_row(self, *args, **kwargs)

    monkeypatch.setattr(DecoderLayer, "forward_one_row", counting)
    got = _generate(path, prompts, attention_backend="triton", page_size=4)
    assert calls, "no step took the one-row path"
    for g, w in zip(got, want):
        assert g["token_ids"] == w["token_ids"]
        torch.testing.assert_close(g["logprobs"], w["logprobs"], atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_fp8_fused_path_matches_the_reference_path(arch, tiny_model_dir, tmp_path, monkeypatch):
    """FP8 weights and KV through the fused kernels (one-row GEMVs with e4m3 weights, the
    several-row GEMV up to 4 rows, the FP8 GEMM with per-token activation quantization above,
    the FP8 MoE kernels, the e4m3 KV store / decode / extend) against the torch layers on the
    same e4m3 values: the same numerics up to fp32 summation order."""
    if arch == "qwen3_moe":
        save_tiny(tmp_path, seed=4)
        path = str(tmp_path)
    else:
        path = str(tiny_model_dir(arch))
    fp8 = {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3", "fp8_gemv_max_rows": 4}
    prompts = random_prompts(6, 256, seed=7, lo=2, hi=20)
    want = _generate(path, prompts[:2], attention_backend="torch", **fp8)
    llm = LLM(
        path, dtype="float32", device="cpu", skip_warmup=True, attention_backend="torch", **fp8
    )
    want_batch = llm.generate(prompts, PARAMS, use_tqdm=False)

    force_fused_kernels(monkeypatch)
    got = _generate(path, prompts[:2], attention_backend="triton", page_size=4, **fp8)
    llm = LLM(path, dtype="float32", device="cpu", skip_warmup=True, attention_backend="triton",
              page_size=4, **fp8)  # fmt: skip
    got_batch = llm.generate(prompts, PARAMS, use_tqdm=False)
    for g, w in zip(got + got_batch, want + want_batch):
        assert g["token_ids"] == w["token_ids"]
        torch.testing.assert_close(g["logprobs"], w["logprobs"], atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("arch", "options"),
    [
        ("llama3", {"skinny_max_rows": 16}),
        pytest.param("qwen2", {"skinny_max_rows": 16}, marks=pytest.mark.slow),  # a qkv bias
        pytest.param(
            "qwen3",
            {"quantization": "fp8", "fp8_gemv_max_rows": 4, "fp8_skinny": True},
            marks=pytest.mark.slow,
        ),
    ],
)
def test_few_row_steps_take_the_skinny_gemm(arch, options, tiny_model_dir, monkeypatch):
    """Batched decode steps (three rows) through the dense layers' fused few-row path with the
    skinny GEMM (`skinny_max_rows`, and the LM head's skinny product; or FP8 weight-only rows
    with `fp8_skinny`, one row included) against the torch layers on the same weights."""
    path = str(tiny_model_dir(arch))
    prompts = random_prompts(3, 256, seed=6, lo=2, hi=20)
    common = {"dtype": "float32", "device": "cpu", "skip_warmup": True, **options}
    want = LLM(path, attention_backend="torch", **common).generate(prompts, PARAMS, use_tqdm=False)

    force_fused_kernels(monkeypatch)
    rows = []
    one_row = DecoderLayer.forward_one_row

    def counting(self, gemv, x, *args, **kwargs):
        rows.append((x.shape[0], gemv.__name__))
        return one_row(self, gemv, x, *args, **kwargs)

    monkeypatch.setattr(DecoderLayer, "forward_one_row", counting)
    llm = LLM(path, attention_backend="triton", page_size=4, **common)
    got = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert (3, "skinny") in rows, f"no three-row step took the skinny GEMM: {set(rows)}"
    for g, w in zip(got, want):
        assert g["token_ids"] == w["token_ids"]
        torch.testing.assert_close(g["logprobs"], w["logprobs"], atol=1e-4, rtol=0)
    assert_kv_clean(llm)
