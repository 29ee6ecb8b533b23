"""Admission's KV reservation share: it decays from `reserve_ratio` to `min_reserve_ratio` while
steps run without retraction, so more requests run at once; a retraction resets it. Outputs stay
those of a scheduler that never lowers its reservation."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import assert_kv_clean, random_prompts

from minisgl import LLM, SamplingParams
from minisgl.config import EngineConfig
from minisgl.core import Req

POOL = {"num_pages": 100, "page_size": 4, "reserve_ratio": 0.5, "reserve_decay_steps": 8}


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return tiny_model_dir("qwen3")


def run(path: Any, min_ratio: float, spy_retract: bool = False) -> tuple[list[Req], dict]:
    """Ten requests through a small pool, stepping by hand; what the run saw."""
    llm = LLM(str(path), dtype="float32", device="cpu", min_reserve_ratio=min_ratio, **POOL)
    sched = llm.scheduler
    seen: dict[str, Any] = {"max_running": 0, "ratios": [], "after_retraction": []}
    if spy_retract:
        original = sched._retract

        def retract(req: Req) -> None:
            original(req)
            seen["after_retraction"].append(sched.reserve_ratio)

        sched._retract = retract  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    reqs = [
        Req(rid=str(i), prompt_ids=p, params=params, seed=0)
        for i, p in enumerate(random_prompts(10, 384, seed=9, lo=20, hi=40))
    ]
    for r in reqs:
        sched.add_request(r)
    while sched.has_work:
        sched.step()
        sched.check_invariants()
        seen["max_running"] = max(seen["max_running"], len(sched.running))
        seen["ratios"].append(sched.reserve_ratio)
    seen["retractions"] = sched.stats["retractions"]
    assert_kv_clean(llm)
    return reqs, seen


def test_decaying_reservation_runs_more_at_once_with_the_same_outputs(model_path):
    fixed, seen_fixed = run(model_path, min_ratio=0.5)
    decayed, seen = run(model_path, min_ratio=0.1, spy_retract=True)
    assert set(seen_fixed["ratios"]) == {0.5}
    assert min(seen["ratios"]) == pytest.approx(0.1)
    assert seen["max_running"] > seen_fixed["max_running"]
    # Lower reservations can run the pool short: each retraction puts the share back.
    assert seen["retractions"] == len(seen["after_retraction"])
    assert all(r == 0.5 for r in seen["after_retraction"])
    for a, b in zip(fixed, decayed):
        assert a.output_ids == b.output_ids and len(a.output_ids) == 40


def test_reservation_options_are_checked():
    with pytest.raises(ValueError, match="min_reserve_ratio"):
        EngineConfig(min_reserve_ratio=0.0)
    with pytest.raises(ValueError, match="reserve_decay_steps"):
        EngineConfig(reserve_decay_steps=0)
