"""Greedy outputs with speculative decoding are token-identical to those without (fp32, CPU),
for both proposers, tiny random Llama-3 and Qwen3 models, batched, with chunked prefill, the
radix cache, page sizes 1 and 16, retraction forced by a small pool, overlap scheduling forced
on, an abort in flight, stop ids and max_tokens; the KV invariant holds after every step and
the pool is whole at the end (the tests run in the KV debug mode)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from helpers import assert_kv_clean, checked_llm, random_prompts

from minisgl import LLM, SamplingParams
from minisgl.core import Req

NUM_TOKENS = 24
VOCAB = 384


def prompts() -> list[list[int]]:
    """Random prompts, some sharing a prefix (radix matches), some repeating themselves
    (n-gram matches), of lengths that need several chunks."""
    ps = random_prompts(6, VOCAB, seed=7, lo=5, hi=40)
    shared = ps[0][:20]
    return [*ps[:3], shared + ps[3], ps[4] * 3, shared + ps[5][:4] * 4]


GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=True)


def make_llm(path: Any, overlap: bool = False, **options: Any) -> LLM:
    options.setdefault("max_prefill_tokens", 32)  # chunked prefill
    # Two-token matches: the tiny models' short outputs repeat pairs sooner than triples, so
    # more steps verify drafts (what these tests check).
    options.setdefault("speculative_ngram_min_n", 2)
    return checked_llm(path, overlap, skip_warmup=True, **options)  # type: ignore[no-any-return]


def generate(llm: LLM, params: SamplingParams = GREEDY) -> list[dict[str, Any]]:
    outs = llm.generate(prompts(), params, use_tqdm=False)
    assert_kv_clean(llm)
    return outs


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> Any:
    """Outputs without speculation, per (arch, page size)."""
    made: dict[tuple[str, int], list[dict[str, Any]]] = {}

    def get(arch: str, page_size: int) -> list[dict[str, Any]]:
        if (arch, page_size) not in made:
            made[arch, page_size] = generate(make_llm(tiny_model_dir(arch), page_size=page_size))
        return made[arch, page_size]

    return get


def assert_same(ref: list[dict[str, Any]], out: list[dict[str, Any]]) -> None:
    for a, b in zip(ref, out, strict=True):
        assert b["token_ids"] == a["token_ids"]
        assert b["finish_reason"] == a["finish_reason"]
        if "logprobs" in a:
            assert all(
                math.isclose(x, y, abs_tol=1e-4) for x, y in zip(a["logprobs"], b["logprobs"])
            )


def spec_stats(llm: LLM) -> Any:
    assert llm.scheduler.spec is not None
    return llm.scheduler.spec.stats


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    ("arch", "algo", "page_size"),
    [
        ("qwen3", "ngram", 16),
        ("llama3", "draft", 1),
        pytest.param("qwen3", "ngram", 1, marks=SLOW),
        pytest.param("qwen3", "draft", 1, marks=SLOW),
        pytest.param("qwen3", "draft", 16, marks=SLOW),
        pytest.param("llama3", "ngram", 1, marks=SLOW),
        pytest.param("llama3", "ngram", 16, marks=SLOW),
        pytest.param("llama3", "draft", 16, marks=SLOW),
    ],
)
def test_greedy_identical(tiny_model_dir, reference, arch, algo, page_size) -> None:
    llm = make_llm(tiny_model_dir(arch), page_size=page_size, speculative_algorithm=algo)
    out = generate(llm)
    assert_same(reference(arch, page_size), out)
    stats = spec_stats(llm)
    assert stats.verify_rows > 0 and stats.proposed > stats.verify_rows
    if algo == "ngram":
        assert stats.accepted > 0  # the looping outputs of a random model repeat themselves


@pytest.mark.parametrize("algo", [pytest.param("ngram", marks=SLOW), "draft"])
def test_retraction_with_a_small_pool(tiny_model_dir, reference, algo) -> None:
    """Six requests in a pool that holds about three: retractions while drafts come and go."""
    llm = make_llm(
        tiny_model_dir("qwen3"),
        page_size=16,
        num_pages=12,
        reserve_ratio=0.05,  # admit all six: decoding runs short
        min_reserve_ratio=0.05,
        speculative_algorithm=algo,
        speculative_draft_layers=2,
    )
    out = generate(llm)
    assert llm.scheduler.stats["retractions"] > 0
    assert spec_stats(llm).accepted > 0
    assert_same(reference("qwen3", 16), out)


@pytest.mark.parametrize("algo", ["ngram", "draft", "draft_model"])
def test_verify_and_draft_steps_through_the_decode_graph(tiny_model_dir, reference, algo) -> None:
    """The CUDA-graph path of a GPU (run eagerly on the CPU, `capture=False`): verify plans
    replay the decode graph with a row per token (drafts attending up to themselves), and the
    layer-skip draft its own graph of the first layers (a draft model: of its own model); the
    outputs are the same."""
    from minisgl.engine.cuda_graph import CudaGraphRunner
    from minisgl.engine.speculative import make_device_proposer

    path = tiny_model_dir("qwen3")
    options: dict[str, Any] = {"speculative_algorithm": "ngram" if algo == "ngram" else "draft"}
    if algo == "draft_model":  # the target as its own draft: its drafts are accepted
        options["speculative_draft_model"] = str(path)
    llm = make_llm(path, page_size=16, **options)
    engine = llm.engine
    engine.graphs = CudaGraphRunner(engine, capture=False, max_bs=24)
    engine.drafter = make_device_proposer(engine)
    calls = {"verify": 0, "draft": 0}
    run_rows = CudaGraphRunner.run_rows

    def counted(self: CudaGraphRunner, slots: list[int], *rest: list[int]) -> Any:
        if self.num_layers is not None or self.engine is engine.draft_model:
            calls["draft"] += 1
        elif len(set(slots)) < len(slots):  # rows sharing a request: a verify plan
            calls["verify"] += 1
        return run_rows(self, slots, *rest)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CudaGraphRunner, "run_rows", counted)
        out = generate(llm)
    assert_same(reference("qwen3", 16), out)
    assert calls["verify"] > 0 and spec_stats(llm).accepted > 0
    assert (calls["draft"] > 0) == (algo != "ngram")


def test_overlap_forced_on(tiny_model_dir, reference) -> None:
    """Overlap scheduling: the step in flight is finished before a verify step."""
    llm = make_llm(tiny_model_dir("qwen3"), True, speculative_algorithm="ngram")
    assert_same(reference("qwen3", 1), generate(llm))
    assert spec_stats(llm).accepted > 0


@pytest.mark.parametrize("algo", ["ngram", "draft"])
def test_abort_in_flight(tiny_model_dir, reference, algo) -> None:
    """One request aborted after its first verify steps: the others are unchanged and the pool
    is whole."""
    llm = make_llm(tiny_model_dir("qwen3"), speculative_algorithm=algo)
    sched = llm.scheduler
    reqs = [Req(f"r{i}", p, GREEDY, seed=0) for i, p in enumerate(prompts())]
    for r in reqs:
        sched.add_request(r)
    victim = reqs[4]
    while sched.has_work:
        sched.step()
        if victim.output_ids and len(victim.output_ids) > 3 and not victim.finished:
            assert sched.abort(victim.rid) is victim
            sched.check_invariants()
    assert_kv_clean(llm)
    ref = reference("qwen3", 1)
    for i, r in enumerate(reqs):
        if r is not victim:
            assert r.output_ids == ref[i]["token_ids"]
    assert victim.finish_reason is not None and victim.finish_reason.value == "abort"
    assert ref[4]["token_ids"][: len(victim.output_ids)] == victim.output_ids


def test_stop_ids_and_max_tokens(tiny_model_dir, reference) -> None:
    """A stop id in the middle of an accepted run ends the output there; max_tokens is never
    exceeded."""
    ref = reference("qwen3", 1)
    stop = ref[4]["token_ids"][9]  # inside the looping output of the repeated prompt
    params = SamplingParams(max_tokens=13, temperature=0, stop_token_ids=[stop], ignore_eos=True)
    base = generate(make_llm(tiny_model_dir("qwen3")), params)
    llm = make_llm(tiny_model_dir("qwen3"), speculative_algorithm="ngram")
    out = generate(llm, params)
    assert_same(base, out)
    assert all(len(o["token_ids"]) <= 13 for o in out)
    assert any(o["finish_reason"] == "stop" for o in out)
    assert spec_stats(llm).accepted > 0


def test_penalties_min_tokens_and_bias_see_the_drafts(tiny_model_dir) -> None:
    """Greedy with a repetition penalty, a frequency penalty, min_tokens holding back a stop id
    and a logit bias: each verified position is adjusted as if the drafts before it had been
    sampled, so the output is the one without speculation."""
    path = tiny_model_dir("qwen3")
    ref = generate(make_llm(path))
    stop = ref[4]["token_ids"][2]
    params = SamplingParams(
        max_tokens=NUM_TOKENS,
        temperature=0,
        repetition_penalty=1.2,
        frequency_penalty=0.3,
        min_tokens=6,
        stop_token_ids=[stop],
        logit_bias={ref[4]["token_ids"][5]: 2.0},
        logprobs=True,
        top_logprobs=2,
    )
    base = generate(make_llm(path), params)
    llm = make_llm(path, speculative_algorithm="ngram")
    out = generate(llm, params)
    assert_same(base, out)
    for a, b in zip(base, out):
        assert [t for t, _ in sum(a["top_logprobs"], [])] == [
            t for t, _ in sum(b["top_logprobs"], [])
        ]
    assert spec_stats(llm).verify_rows > 0


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_model_dir) -> None:
    """Speculative sampling draws from the request's own hashed numbers: the same seed gives the
    same tokens twice, and alone the same as in a batch."""
    path = tiny_model_dir("qwen3")
    # One-token matches: sampled text of a random model rarely repeats two tokens in a row.
    llm = make_llm(path, speculative_algorithm="ngram", speculative_ngram_min_n=1)
    params = SamplingParams(
        max_tokens=NUM_TOKENS, temperature=0.7, top_p=0.9, min_p=0.05, seed=5, ignore_eos=True
    )
    first = generate(llm, params)
    again = generate(llm, params)
    assert [o["token_ids"] for o in first] == [o["token_ids"] for o in again]
    alone = llm.generate([prompts()[4]], params, use_tqdm=False)[0]
    assert alone["token_ids"] == first[4]["token_ids"]
    assert spec_stats(llm).verify_rows > 0


# ---- a separate draft model -----------------------------------------------------------------


@pytest.mark.parametrize(("draft", "page_size"), [("qwen3", 16), ("llama3", 1)])
def test_a_draft_model_gives_the_same_answers(tiny_model_dir, reference, draft, page_size) -> None:
    """A draft model of the same vocabulary, its own pool over the target's pages: the target
    itself as its own draft has (nearly) every draft accepted, which only K/V of every earlier
    position in the draft pool gives (caught up over the prompt and the plain decode steps,
    kept over accepted drafts); another model's drafts change nothing either."""
    llm = make_llm(
        tiny_model_dir("qwen3"),
        page_size=page_size,
        speculative_algorithm="draft",
        speculative_draft_model=str(tiny_model_dir(draft)),
    )
    assert llm.engine.draft_model is not None
    assert_same(reference("qwen3", page_size), generate(llm))
    stats = spec_stats(llm)
    assert stats.verify_rows > 0
    if draft == "qwen3":
        assert stats.accepted >= 0.95 * stats.proposed, stats


def test_a_draft_model_with_retraction_and_an_abort(tiny_model_dir, reference) -> None:
    """Requests retracted (their pages freed, their draft K/V forgotten with their admission)
    and one aborted in flight: the others' answers are unchanged and both pools whole."""
    path = tiny_model_dir("qwen3")
    llm = make_llm(
        path,
        page_size=16,
        num_pages=12,
        reserve_ratio=0.05,
        min_reserve_ratio=0.05,
        speculative_algorithm="draft",
        speculative_draft_model=str(path),
    )
    out = generate(llm)
    assert llm.scheduler.stats["retractions"] > 0
    assert_same(reference("qwen3", 16), out)
    stats = spec_stats(llm)
    assert stats.accepted >= 0.95 * stats.proposed, stats


def test_draft_model_options_are_checked(tiny_model_dir, tmp_path) -> None:
    from helpers import randomize, tiny_hf_config
    from transformers import AutoModelForCausalLM

    path = str(tiny_model_dir("qwen3"))
    with pytest.raises(ValueError, match="needs speculative_algorithm 'draft'"):
        LLM(path, device="cpu", speculative_algorithm="ngram", speculative_draft_model=path)
    other = AutoModelForCausalLM.from_config(tiny_hf_config("qwen3", vocab=VOCAB + 1))
    randomize(other, 0)
    other.save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(ValueError, match="share the vocabulary"):
        LLM(
            path, device="cpu", speculative_algorithm="draft", speculative_draft_model=str(tmp_path)
        )
