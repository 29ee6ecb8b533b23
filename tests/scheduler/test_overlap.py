"""Overlap scheduling, forced on the CPU: the same outputs as the plain loop, and requests that
finish, are aborted or are retracted while their step is in flight free everything exactly once
(the allocators assert on double frees) with the KV accounting intact after every step.

The tests run in the KV debug mode (tests/conftest.py): pages given back are poisoned with NaN
and a page or slot given back while a launched step references it fails an assertion. On the
CPU a step counts as completed once the scheduler has waited for it, so what a released request
held waits for its last step exactly as it does on a GPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import assert_kv_clean, checked_llm, random_prompts

from minisgl import LLM, SamplingParams
from minisgl.core import Req

NUM_TOKENS = 24


def make_llm(path: Any, overlap: bool, **options: Any) -> LLM:
    return checked_llm(path, overlap, **options)  # type: ignore[no-any-return]


def mixed_params(n: int) -> list[SamplingParams]:
    kinds = [
        SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=NUM_TOKENS - 7, temperature=0.8, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=NUM_TOKENS, top_p=0.9, seed=5, ignore_eos=True),
        SamplingParams(
            max_tokens=NUM_TOKENS - 3,
            temperature=0.7,
            seed=3,
            presence_penalty=0.5,
            repetition_penalty=1.3,
            ignore_eos=True,
        ),
    ]
    return [kinds[i % len(kinds)] for i in range(n)]


def run_checked(llm: LLM) -> None:
    """Step to the end, checking the KV invariant after every step."""
    sched = llm.scheduler
    while sched.has_work:
        sched.step()
        sched.check_invariants()


def generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[dict]:
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return tiny_model_dir("qwen3")


OPTIONS = [
    {},
    {"max_prefill_tokens": 7},  # chunked prefill: chunks in flight while the next is scheduled
    {"num_pages": 40, "page_size": 4, "max_prefill_tokens": 64},  # queueing and retraction
    {"page_size": 16, "cache": "radix"},
]


@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "chunked", "small-pool", "page16"])
def test_overlap_matches_the_plain_loop(model_path, options):
    prompts = random_prompts(9, 384, seed=1)
    prompts += [prompts[0][:20] + p for p in random_prompts(3, 384, seed=2)]  # shared prefixes
    params = mixed_params(len(prompts))
    plain = make_llm(model_path, overlap=False, **options)
    overlap = make_llm(model_path, overlap=True, **options)
    want = generate(plain, prompts, params)
    got = generate(overlap, prompts, params)
    for g, w in zip(got, want):
        assert g["token_ids"] == w["token_ids"]
        assert g["finish_reason"] == w["finish_reason"]
    assert_kv_clean(overlap)
    if "num_pages" in options:
        assert overlap.scheduler.stats["retractions"] > 0, "the small pool should retract"


@pytest.mark.parametrize("page_size", [1, 16])
def test_stop_tokens_while_the_next_step_is_in_flight(model_path, page_size):
    prompts = random_prompts(8, 384, seed=4)
    greedy = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    full = generate(make_llm(model_path, overlap=False), prompts, [greedy] * len(prompts))
    # Stop half of the requests at a token they produce early on.
    params = [
        SamplingParams(max_tokens=NUM_TOKENS, temperature=0, stop_token_ids=[o["token_ids"][3]])
        if i % 2 == 0
        else greedy
        for i, o in enumerate(full)
    ]
    plain = generate(make_llm(model_path, overlap=False, page_size=page_size), prompts, params)
    llm = make_llm(model_path, overlap=True, page_size=page_size)
    got = generate(llm, prompts, params)
    assert [g["token_ids"] for g in got] == [p["token_ids"] for p in plain]
    assert any(g["finish_reason"] == "stop" for g in got)
    assert all(len(g["token_ids"]) <= 4 for g in got[::2])
    assert_kv_clean(llm)


def _add(llm: LLM, prompt: list[int], params: SamplingParams, rid: str) -> Req:
    req = Req(rid=rid, prompt_ids=prompt, params=params, seed=0)
    llm.scheduler.add_request(req)
    return req


@pytest.mark.parametrize("page_size", [1, 16])
def test_abort_while_its_step_is_in_flight(model_path, page_size):
    prompts = random_prompts(6, 384, seed=7)
    greedy = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    plain = make_llm(model_path, overlap=False, page_size=page_size)
    want = generate(plain, prompts, [greedy] * len(prompts))
    llm = make_llm(model_path, overlap=True, page_size=page_size)
    sched = llm.scheduler
    reqs = [_add(llm, p, greedy, f"r{i}") for i, p in enumerate(prompts)]
    while not all(len(r.output_ids) >= 2 for r in reqs):
        sched.step()
    assert sched._in_flight is not None
    victim = reqs[2]
    assert victim in sched._in_flight.reqs, "the victim's next step should be in flight"
    slot, pages = victim.slot, list(victim.pages)
    assert sched.abort(victim.rid) is victim
    sched.check_invariants()
    # Its slot and pages wait for the step in flight; a request admitted meanwhile gets others.
    assert sched.kv_accounting()["released"] > 0
    late = _add(llm, prompts[2], greedy, "late")
    sched.step()
    own = late.pages[late.cache_len // llm.engine.page_size :]  # not shared through the cache
    assert late.slot != slot and not set(own) & set(pages)
    run_checked(llm)
    assert victim.finish_reason is not None and victim.finish_reason.value == "abort"
    assert len(victim.output_ids) < NUM_TOKENS
    assert victim.output_ids == want[2]["token_ids"][: len(victim.output_ids)]
    for i, r in enumerate(reqs):
        if r is not victim:
            assert r.output_ids == want[i]["token_ids"]
    assert late.output_ids == want[2]["token_ids"]
    assert_kv_clean(llm)


@pytest.mark.parametrize("page_size, num_pages", [(1, 144), (4, 36), (16, 9)])
def test_retraction_while_a_token_is_in_flight(model_path, monkeypatch, page_size, num_pages):
    prompts = random_prompts(10, 384, seed=9, lo=20, hi=40)
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)] * len(prompts)
    options = {"num_pages": num_pages, "page_size": page_size, "reserve_ratio": 0.1}
    want = generate(make_llm(model_path, overlap=False, **options), prompts, params)
    llm = make_llm(model_path, overlap=True, **options)
    sched = llm.scheduler
    in_flight_at_retraction: list[int] = []
    original = sched._retract

    def spy(req: Req) -> None:
        in_flight_at_retraction.append(req.num_sampled - len(req.output_ids))
        original(req)

    monkeypatch.setattr(sched, "_retract", spy)
    for p, sp in zip(prompts, params):
        _add(llm, p, sp, f"q{len(sched.waiting)}")
    reqs = list(sched.waiting)
    run_checked(llm)
    assert any(n > 0 for n in in_flight_at_retraction), in_flight_at_retraction
    for r, w in zip(reqs, want):
        assert r.output_ids == w["token_ids"]
    assert_kv_clean(llm)


def test_penalty_inputs_come_from_the_token_table(model_path, monkeypatch):
    """The device-side gather of earlier tokens equals the host's lists (plain loop)."""
    from minisgl.engine import sampler

    llm = make_llm(model_path, overlap=False)
    original = sampler.penalty_inputs
    checked = []

    reqs = {}

    def check(seqs, num_out, req_slots, token_table):
        pen = original(seqs, num_out, req_slots, token_table)
        for i, s in enumerate(seqs):
            r = reqs[s]
            prompt = [t for t in pen.prompt_tokens[i].tolist() if t >= 0]
            out = [t for t in pen.output_tokens[i].tolist() if t >= 0]
            assert prompt == r.prompt_ids
            assert out == r.output_ids
        checked.append(len(seqs))
        return pen

    launch = llm.scheduler._launch

    def remember(step_reqs, batch):
        reqs.update(zip(batch.seqs, step_reqs))
        return launch(step_reqs, batch)

    monkeypatch.setattr(llm.scheduler, "_launch", remember)

    monkeypatch.setattr(sampler, "penalty_inputs", check)
    params = SamplingParams(max_tokens=8, temperature=0.5, frequency_penalty=0.4, seed=1)
    generate(llm, random_prompts(3, 384, seed=12), [params] * 3)
    assert checked


def test_plain_loop_by_default_on_cpu(model_path):
    llm = make_llm(model_path, overlap=False)
    assert llm.engine.config.overlap is False and llm.scheduler.overlap is False
    assert torch.device(llm.engine.config.device).type == "cpu"
