"""The KV debug mode catches what it is for: a page or slot given back while a launched step
still references it, and (through the poison) a step that reads a page given back."""

from __future__ import annotations

import math

import pytest
from helpers import random_prompts

from minisgl import LLM, SamplingParams
from minisgl.core import Req
from minisgl.kvcache import PageAllocator, SlotAllocator, make_prefix_cache
from minisgl.scheduler import KVManager


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return tiny_model_dir("qwen3")


def _running(kv: KVManager, n: int) -> Req:
    req = Req("r", list(range(3, 3 + n)), SamplingParams(max_tokens=4), seed=0)
    kv.attach(req)
    kv.grow(req, n)
    return req


def test_a_free_while_its_step_runs_fails() -> None:
    kv = KVManager(PageAllocator(8), SlotAllocator(2), make_prefix_cache("naive", 1), 1, True)
    req = _running(kv, 3)
    kv.launched(1, [req])
    kv.release(req, 0)  # wrong: step 1 was launched, and it reads these pages
    with pytest.raises(AssertionError, match="freed while step 1 runs"):
        kv.reclaim(0)


def test_release_waits_for_the_last_step() -> None:
    kv = KVManager(PageAllocator(8), SlotAllocator(2), make_prefix_cache("radix", 1), 1, True)
    req = _running(kv, 3)
    kv.launched(1, [req])
    kv.release(req, 1)
    kv.reclaim(0)  # step 1 still runs: nothing comes back
    assert kv.allocator.num_free == 5 and kv.slots.num_free == 1 and kv.deferred_pages == 3
    kv.reclaim(1)
    assert kv.allocator.num_free == 8 and kv.slots.num_free == 2 and kv.deferred_pages == 0
    assert kv.take_writes()[2] == [0, 1, 2]  # for the engine to poison


def test_poisoned_pages_show_in_the_output(model_path) -> None:
    """Pages listed as freed in a plan are overwritten with NaN before the step: a request
    whose pages were (wrongly) given back while it runs stops producing its tokens."""
    llm = LLM(str(model_path), dtype="float32", device="cpu")
    prompt = random_prompts(1, 384, seed=3, lo=12, hi=13)[0]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=True)
    clean = llm.generate([prompt], params, use_tqdm=False)[0]
    sched = llm.scheduler
    req = Req("victim", prompt, params, seed=0)
    sched.add_request(req)
    sched.step()  # prefill
    sched.kv._freed.extend(req.pages[:4])  # as if they had been given back
    while sched.has_work:
        sched.step()
    assert clean["logprobs"] and all(math.isfinite(x) for x in clean["logprobs"])
    assert not all(math.isfinite(x) for x in req.output_logprobs[1:])
