"""Prefilling steps through the piecewise runner (`minisgl.engine.piecewise`), run without
capture on the CPU: the same padded, split forward the graphs replay on a GPU. Its answers must
be the eager engine's: padding rows never reach a real one, and each layer's attention output
lands where the next piece reads it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_kv_clean, random_prompts, save_tiny_model

from minisgl import LLM, SamplingParams
from minisgl.engine.piecewise import PiecewiseGraphRunner, token_buckets


def test_token_buckets_cover_every_count_up_to_the_largest() -> None:
    for top in (1, 32, 100, 2048, 3000, 8192):
        sizes = token_buckets(top)
        assert sizes == sorted(set(sizes)) and sizes[-1] == top and sizes[0] >= 1
        # Up to 2048 tokens, padding to the next bucket adds at most an eighth (or 32 tokens).
        assert all(b - a <= max(32, a // 8) for a, b in zip(sizes, sizes[1:]) if b <= 2048)


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_piecewise_steps_give_the_eager_answers(tmp_path: Path, arch: str) -> None:
    path = save_tiny_model(arch, tmp_path / "model", seed=3)
    # A small token budget: prompts are chunked, and chunks share steps with decodes.
    opts: dict[str, Any] = dict(dtype="float32", max_prefill_tokens=40, skip_warmup=True)
    prompts = random_prompts(6, 384, seed=5, lo=5, hi=90)
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=True)
    want = LLM(str(path), **opts).generate(prompts, params, use_tqdm=False)

    llm = LLM(str(path), **opts)
    runner = PiecewiseGraphRunner(llm.engine, 48, capture=False)
    counts: list[int] = []
    run = runner.run

    def counted(batch: Any) -> Any:
        counts.append(batch.num_tokens)
        return run(batch)

    runner.run = counted  # type: ignore[method-assign]
    llm.engine.pieces = runner
    got = llm.generate(prompts, params, use_tqdm=False)
    # Mixed steps went through it, at token counts that are no bucket (so padded).
    assert counts and any(n not in runner.sizes for n in counts)
    for w, g in zip(want, got, strict=True):
        assert g["token_ids"] == w["token_ids"]
        torch.testing.assert_close(
            torch.tensor(g["logprobs"]), torch.tensor(w["logprobs"]), atol=1e-4, rtol=1e-4
        )
    assert_kv_clean(llm)
