"""The host tier on CUDA (marker `gpu`; skipped without CUDA): the copies run on the side
stream with overlap scheduling and CUDA graphs on, and greedy answers equal those without the
tier (in deterministic mode), bf16 and FP8 KV, page 16 and 1, with a spilling disk tier."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_kv_clean, random_prompts

from minisgl import LLM, SamplingParams

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

POOL_TOKENS = 512
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def conversations(llm: LLM, n: int = 16, turns: int = 4) -> list[list[int]]:
    history: list[list[int]] = [[] for _ in range(n)]
    answers = []
    for t in range(turns):
        users = random_prompts(n, 384, seed=200 + t, lo=40, hi=60)
        prompts = [h + u for h, u in zip(history, users)]
        for i, out in enumerate(llm.generate(prompts, GREEDY, use_tqdm=False)):
            history[i] = prompts[i] + out["token_ids"]
            answers.append(out["token_ids"])
    assert sum(map(len, history)) >= 4 * POOL_TOKENS
    return answers


def run(path: Path, page_size: int, **kw: Any) -> tuple[list[list[int]], dict]:
    # Without the tier a returning turn computes its history again, in other batches and chunks
    # than the K/V the tier keeps; in bf16 that rounds differently, and a random model's
    # near-tied logits flip on it. Deterministic mode makes both bit-identical.
    llm = LLM(str(path), page_size=page_size, num_pages=POOL_TOKENS // page_size,
              deterministic=True, **kw)  # fmt: skip
    assert llm.scheduler.overlap
    answers = conversations(llm)
    assert_kv_clean(llm)
    return answers, llm.scheduler.tier_stats()


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_answers_are_those_without_the_tier(tiny_model_dir, tmp_path, page_size, kv_dtype):
    path = tiny_model_dir("llama3")
    off, _ = run(path, page_size, kv_cache_dtype=kv_dtype)
    on, stats = run(path, page_size, kv_cache_dtype=kv_dtype, kv_host_gib=0.05)
    assert on == off and stats["host_hit_pages"] * page_size > POOL_TOKENS
    assert stats["load_copy_s"] > 0
    host = 128 * 2 * 2 * 2 * 16 * 2 / (1 << 30)  # 128 bf16 tokens (fewer in FP8 bytes: more)
    disk, stats = run(path, page_size, kv_cache_dtype=kv_dtype, kv_host_gib=host,
                      kv_disk_dir=str(tmp_path))  # fmt: skip
    assert disk == off and stats["disk_hit_pages"] > 0
