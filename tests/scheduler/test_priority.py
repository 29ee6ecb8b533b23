"""The priority schedule policy (`minisgl.scheduler.policy`) through the real scheduler and a
tiny model: with a KV pool too small for everyone, urgent requests that arrive late retract the
less urgent ones and finish first, nothing is lost, and every greedy output is the one the
request gets alone; the starvation guard lets an old low-priority request overtake newer
urgent ones; priorities a policy cannot honour are refused."""

from __future__ import annotations

import time
from typing import Any

import pytest
from helpers import assert_kv_clean, random_prompts

from minisgl import LLM, SamplingParams
from minisgl.config import EngineConfig
from minisgl.core import FinishReason, InvalidRequestError, Req

URGENT, LOW = 0, 5


@pytest.fixture(scope="module")
def model_path(tiny_model_dir: Any) -> Any:
    return tiny_model_dir("qwen3")


def params(priority: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, priority=priority)


def run(llm: LLM, first: list[Req], later: list[Req], steps_between: int) -> list[str]:
    """Add `first`, step, add `later`, step to the end; the order in which requests finished."""
    sched, done = llm.scheduler, []
    for r in first:
        sched.add_request(r)
    for _ in range(steps_between):
        sched.step()
    for r in later:
        sched.add_request(r)
    while sched.has_work:
        done += [ev.req.rid for ev in sched.step() if ev.finished]
        sched.check_invariants()
    assert_kv_clean(llm)
    return done


def workload(low_priority: int = LOW) -> tuple[list[Req], list[Req]]:
    prompts = random_prompts(8, 384, seed=11, lo=18, hi=30)
    # Less urgent ones ask for more tokens, so that one resumed beside the last urgent request
    # cannot finish before it.
    low = [Req(f"low{i}", p, params(low_priority, 48), seed=0) for i, p in enumerate(prompts[:4])]
    urgent = [Req(f"urgent{i}", p, params(URGENT, 24), seed=0) for i, p in enumerate(prompts[4:])]
    return low, urgent


def small_pool_llm(path: Any, policy: str) -> LLM:
    # 48 pages of 4 tokens: about two requests at a time.
    return LLM(str(path), dtype="float32", device="cpu", page_size=4, num_pages=48,
               schedule_policy=policy, itl_target_ms=0)  # fmt: skip


def test_urgent_requests_finish_first_and_nothing_is_lost(model_path: Any) -> None:
    llm = small_pool_llm(model_path, "priority")
    low, urgent = workload()
    order = run(llm, low, urgent, steps_between=3)
    sched = llm.scheduler
    assert sorted(order) == sorted(r.rid for r in low + urgent)  # each finished exactly once
    assert set(order[:4]) == {r.rid for r in urgent}
    # Room for the urgent ones came from retracting less urgent requests, never urgent ones.
    assert sched.stats["retractions"] > 0
    assert set(sched.retractions_by_priority) == {LOW}
    for r in low + urgent:
        assert r.finish_reason is FinishReason.LENGTH and len(r.output_ids) == r.params.max_tokens
    # Retracted and resumed or not, each output is the request's own.
    ref = LLM(str(model_path), dtype="float32", device="cpu", page_size=4)
    for r in low + urgent:
        alone = ref.generate([r.prompt_ids], params(0, r.params.max_tokens), use_tqdm=False)
        assert r.output_ids == alone[0]["token_ids"], r.rid
    # First come, first served (no priorities): the early ones finish first.
    low, urgent = workload(low_priority=0)
    fcfs = run(small_pool_llm(model_path, "fcfs"), low, urgent, steps_between=3)
    assert fcfs[0].startswith("low")


def test_an_old_low_priority_request_overtakes_newer_urgent_ones(model_path: Any) -> None:
    def order(aging_s: float) -> list[str]:
        llm = LLM(str(model_path), dtype="float32", device="cpu", max_running_requests=1,
                  schedule_policy="priority", priority_aging_s=aging_s)  # fmt: skip
        sched, done = llm.scheduler, []
        prompts = random_prompts(3, 384, seed=12, lo=5, hi=10)
        sched.add_request(Req("urgent0", prompts[0], params(0, 6), seed=0))
        sched.add_request(Req("old", prompts[1], params(10, 6), seed=0))
        done += [ev.req.rid for ev in sched.step() if ev.finished]
        time.sleep(0.6)  # "old" has waited 0.6 s: past 10 levels of 0.05 s
        sched.add_request(Req("urgent1", prompts[2], params(0, 6), seed=0))
        while sched.has_work:
            done += [ev.req.rid for ev in sched.step() if ev.finished]
        assert_kv_clean(llm)
        return done

    assert order(0.05) == ["urgent0", "old", "urgent1"]
    assert order(0.0) == ["urgent0", "urgent1", "old"]  # no aging: it waits for every urgent one


def test_priorities_a_policy_cannot_honour_are_refused(model_path: Any) -> None:
    for bad in (1.5, True, "1"):
        with pytest.raises(InvalidRequestError, match="priority: must be an integer"):
            SamplingParams(priority=bad)  # type: ignore[arg-type]
    llm = LLM(str(model_path), dtype="float32", device="cpu", skip_warmup=True)
    ok = SamplingParams(max_tokens=2, temperature=0)
    with pytest.raises(InvalidRequestError, match="priority: 3 needs the priority schedule"):
        llm.generate([[5, 6, 7], [8, 9]], [ok, SamplingParams(max_tokens=2, priority=3)])
    assert not llm.scheduler.has_work  # refused before anything was admitted
    assert len(llm.generate([[5, 6, 7]], ok, use_tqdm=False)[0]["token_ids"]) == 2
    for field, value in (("schedule_policy", "lifo"), ("priority_aging_s", -1.0),
                         ("itl_target_ms", -5.0)):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            EngineConfig(**{field: value})
