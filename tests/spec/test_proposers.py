"""The pieces of speculative decoding on their own: n-gram lookup, the acceptance rule's edge
cases, the per-request policy, the config's checks."""

from __future__ import annotations

import random

import pytest
import torch

from minisgl.config import EngineConfig
from minisgl.spec import DraftRow, NgramIndex, NgramProposer, SpecPolicy
from minisgl.spec.policy import BACKOFF_STEPS, PROBATION_STEPS
from minisgl.spec.verify import accepted_tokens, greedy_verify, rejection_sample


def ngram_lookup(ids: list[int], n: int, k: int, min_n: int = 1) -> list[int]:
    """The rule, by brute force: up to `k` tokens after the latest earlier occurrence (with a
    token after it) of the longest suffix of `min_n` to `n` tokens that has one."""
    for m in range(min(n, len(ids) - 1), min_n - 1, -1):
        key = ids[len(ids) - m :]
        for start in range(len(ids) - m - 1, -1, -1):
            if ids[start : start + m] == key:
                return ids[start + m : start + m + k]
    return []


def index_lookup(ids: list[int], n: int, k: int, min_n: int = 1) -> list[int]:
    index = NgramIndex(n, min_n)
    index.sync(ids, [])
    return index.lookup(k)


def test_ngram_lookup_takes_the_latest_longest_match() -> None:
    ids = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert index_lookup(ids, 2, 3) == [7, 8, 5]  # "2 3" last seen before 7 8 5
    assert index_lookup(ids, 3, 2) == [7, 8]  # "5 2 3" unseen: falls back to "2 3"
    assert index_lookup([4, 5, 6, 4], 3, 4) == [5, 6, 4]  # runs into the suffix itself
    assert index_lookup([1, 2, 3], 3, 4) == []
    assert index_lookup([7], 3, 4) == []
    rows = [DraftRow([1, 2], [1], 0, 1, 3, "a"), DraftRow([3, 4], [], 1, 2, 2, "b")]
    assert NgramProposer(1).propose(rows) == [[2], []]
    # A minimum suffix of two: the lone "3" of [5, 3, 9, 3] no longer proposes its 9.
    assert index_lookup([5, 3, 9, 3], 3, 2) == [9, 3]
    assert index_lookup([5, 3, 9, 3], 3, 2, min_n=2) == []
    assert index_lookup(ids, 3, 2, min_n=2) == [7, 8]
    assert NgramProposer(3, min_n=2).propose(rows) == [[], []]


def test_the_index_follows_a_growing_list_as_the_rule_says() -> None:
    """Kept up to date token by token (and rebuilt for a list that is not its own continued),
    the index proposes what the brute-force rule does, at every length."""
    rng = random.Random(3)
    for n, min_n in ((3, 1), (3, 2), (4, 4)):
        proposer = NgramProposer(n, min_n)
        ids = [rng.randrange(5) for _ in range(3)]
        for _ in range(200):
            ids.append(rng.randrange(5) if rng.random() < 0.5 else ids[rng.randrange(len(ids))])
            cut = 3  # the prompt; the output grows
            got = proposer.propose([DraftRow(ids[:cut], ids[cut:], 0, 3, len(ids), "r")])[0]
            assert got == ngram_lookup(ids, n, 3, min_n)
            assert proposer.hit("r", ids[:cut], ids[cut:]) == bool(got)
        other = ids[:-5] + [9, 9, 9]  # a different list under the same id: rebuilt
        assert proposer.propose([DraftRow(other, [], 0, 3, len(other), "r")])[0] == ngram_lookup(
            other, n, 3, min_n
        )
        proposer.drop("r")
        assert not proposer._index


def test_accepted_tokens() -> None:
    assert accepted_tokens([5, 6, 7], [True, True, True, False], [0, 0, 0, 9]) == [5, 6, 7, 9]
    assert accepted_tokens([5, 6, 7], [True, False, True, False], [0, 4, 0, 9]) == [5, 4]
    assert accepted_tokens([], [False], [3]) == [3]


def test_rejection_rule_edges() -> None:
    """A draft the target surely samples is kept; one it never samples is replaced by a
    token of the rest of the distribution; the last position samples p itself."""
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5], [0.2, 0.3, 0.5]])
    draft = torch.tensor([1, 1, 0])
    has = torch.tensor([True, True, False])
    u = torch.full((3, 3), 0.5)
    v = rejection_sample(probs, draft, has, u)
    assert v.accept.tolist() == [True, False, False]
    assert v.choice[1].item() in (0, 2) and v.choice[2].item() == 2
    g = greedy_verify(torch.tensor([[0.0, 2.0], [3.0, 1.0]]), torch.tensor([1, 1]), has[:2])
    assert g.accept.tolist() == [True, False] and g.choice.tolist() == [1, 0]


def test_policy_backs_off_after_rejections_and_for_large_batches() -> None:
    policy = SpecPolicy(k=4, max_batch=2)
    assert policy.select(["a", "b"]) == {"a", "b"}
    assert policy.select(["a", "b", "c"]) == set()  # more than max_batch
    for _ in range(PROBATION_STEPS):
        policy.record("a", 4, 0)
        policy.record("b", 4, 4)
    assert policy.select(["a", "b"]) == {"b"}
    for _ in range(BACKOFF_STEPS - 1):
        policy.select(["a"])
    assert policy.select(["a"]) == {"a"}  # tries again after its back-off
    for _ in range(PROBATION_STEPS):  # and fails again: twice as long a back-off
        policy.record("a", 4, 0)
    for _ in range(2 * BACKOFF_STEPS):
        assert policy.select(["a"]) == set()
    assert policy.select(["a"]) == {"a"}
    policy.record("a", 4, 0)
    assert policy.stats.proposed == 28 and policy.stats.accepted == 8
    assert policy.stats.verify_rows == 7
    # Waits for tokens in flight that found no draft count like verify steps that kept none:
    # a new request backs off after them; one with a good record keeps speculating.
    for _ in range(PROBATION_STEPS):
        policy.missed("b")
        policy.missed("c")
    assert policy.select(["b", "c"]) == {"b"} and policy.stats.missed == 2 * PROBATION_STEPS
    assert policy.stats.verify_rows == 7


def test_config_checks() -> None:
    with pytest.raises(ValueError, match="speculative_algorithm"):
        EngineConfig(speculative_algorithm="eagle")
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        EngineConfig(speculative_num_draft_tokens=0)
    with pytest.raises(ValueError, match="speculative_ngram_min_n"):
        EngineConfig(speculative_ngram_n=2, speculative_ngram_min_n=3)
    with pytest.raises(ValueError, match="speculative_max_batch"):
        EngineConfig(speculative_max_batch=0)


def test_stats_reach_the_metrics(tiny_model_dir) -> None:
    from helpers import random_prompts

    from minisgl import LLM, SamplingParams
    from minisgl.scheduler.process import SchedulerProcess
    from minisgl.server.metrics import Metrics

    llm = LLM(str(tiny_model_dir("qwen3")), dtype="float32", device="cpu", skip_warmup=True,
              speculative_algorithm="ngram")  # fmt: skip
    prompt = random_prompts(1, 384, seed=4, lo=8, hi=9)[0] * 3
    llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    spec = llm.scheduler.spec
    assert spec is not None and spec.stats.verify_rows > 0
    spec.policy.missed("a request")  # (the overlapped loop's waits that found no draft)
    stats = SchedulerProcess(llm.scheduler, None, None).stats()  # type: ignore[arg-type]
    assert (stats.spec_verify_rows, stats.spec_proposed, stats.spec_accepted) == (
        spec.stats.verify_rows,
        spec.stats.proposed,
        spec.stats.accepted,
    )
    metrics = Metrics()
    metrics.set_scheduler_stats(stats)
    text = metrics.render().decode()
    assert f'minisgl_spec_tokens{{kind="proposed"}} {float(spec.stats.proposed)}' in text
    assert f'minisgl_spec_tokens{{kind="accepted"}} {float(spec.stats.accepted)}' in text
    assert f"minisgl_spec_missed_waits {float(spec.stats.missed)}" in text and spec.stats.missed
    mean = spec.stats.mean_accepted_length
    assert any(
        line.startswith("minisgl_spec_mean_accepted_length ")
        and abs(float(line.split()[1]) - mean) < 1e-9
        for line in text.splitlines()
    )
