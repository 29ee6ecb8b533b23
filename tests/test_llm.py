"""The offline LLM API: seeds, batch independence, bad input, KV accounting."""

from __future__ import annotations

import json

import pytest
from helpers import assert_kv_clean, random_prompts

from minisgl import LLM, SamplingParams
from minisgl.core import InvalidRequestError
from minisgl.weights import ModelNotFoundError


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("llama3")), dtype="float32", device="cpu", page_size=4)


def test_seeded_sampling_repeats_alone_and_in_a_batch(llm):
    prompts = random_prompts(6, 384, seed=3)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    alone = llm.generate([prompts[0]], seeded, use_tqdm=False)[0]["token_ids"]
    again = llm.generate([prompts[0]], seeded, use_tqdm=False)[0]["token_ids"]
    others = SamplingParams(max_tokens=20, temperature=1.0)
    batch = llm.generate(prompts, [seeded] + [others] * 5, use_tqdm=False)
    assert alone == again == batch[0]["token_ids"]
    unseeded = llm.generate([prompts[0]] * 4, others, use_tqdm=False)
    assert len({tuple(o["token_ids"]) for o in unseeded}) > 1, "unseeded draws should differ"
    assert_kv_clean(llm)


def test_top_k_1_equals_greedy(llm):
    prompts = random_prompts(4, 384, seed=4)
    greedy = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)
    topk1 = llm.generate(
        prompts, SamplingParams(max_tokens=10, temperature=1.5, top_k=1), use_tqdm=False
    )
    assert [g["token_ids"] for g in greedy] == [t["token_ids"] for t in topk1]


def test_stop_token_ids_and_max_tokens(llm):
    prompt = random_prompts(1, 384, seed=5)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)
    ids = free[0]["token_ids"]
    assert len(ids) == 10 and free[0]["finish_reason"] == "length"
    stop_at = ids[4]
    out = llm.generate(
        [prompt],
        SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at]),
        use_tqdm=False,
    )[0]
    assert out["finish_reason"] == "stop"
    assert out["token_ids"] == ids[: ids.index(stop_at) + 1]


def test_min_tokens_keeps_stop_token_ids_from_being_sampled(llm):
    prompt = random_prompts(1, 384, seed=5)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)
    stop_at = free[0]["token_ids"][1]  # would end the request after 2 tokens
    outs = llm.generate(
        [prompt] * 2,
        [
            SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at]),
            SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at], min_tokens=6),
        ],
        use_tqdm=False,
    )
    assert outs[0]["token_ids"] == free[0]["token_ids"][:2] and outs[0]["matched_stop"] == stop_at
    ids = outs[1]["token_ids"]
    assert len(ids) >= 6 and stop_at not in ids[:6]
    assert ids[:1] == free[0]["token_ids"][:1]  # the same until the masked step
    if outs[1]["finish_reason"] == "stop":
        assert ids[-1] == stop_at and outs[1]["matched_stop"] == stop_at
    assert_kv_clean(llm)


def test_stop_strings_need_a_tokenizer(llm):
    prompt = random_prompts(1, 384, seed=5)[0]
    with pytest.raises(InvalidRequestError, match="stop: .*stop_token_ids"):
        llm.generate([prompt], SamplingParams(max_tokens=4, stop=["x"]), use_tqdm=False)
    assert_kv_clean(llm)


def test_logprobs_are_consistent(llm):
    prompt = random_prompts(1, 384, seed=6)[0]
    out = llm.generate(
        [prompt],
        SamplingParams(max_tokens=5, temperature=0, logprobs=True, top_logprobs=3),
        use_tqdm=False,
    )[0]
    assert len(out["logprobs"]) == 5 and len(out["top_logprobs"]) == 5
    for tok, lp, top in zip(out["token_ids"], out["logprobs"], out["top_logprobs"]):
        assert top[0][0] == tok and abs(top[0][1] - lp) < 1e-6  # greedy: the top one
        assert lp <= 0 and top[0][1] >= top[1][1] >= top[2][1]


@pytest.mark.parametrize(
    "make",
    [
        lambda: SamplingParams(max_tokens=0),
        lambda: SamplingParams(temperature=-0.1),
        lambda: SamplingParams(top_p=0.0),
        lambda: SamplingParams(top_p=1.5),
        lambda: SamplingParams(top_k=0),
        lambda: SamplingParams(min_p=2.0),
        lambda: SamplingParams(max_tokens=4, min_tokens=5),
        lambda: SamplingParams(min_tokens=-1),
        lambda: SamplingParams(logit_bias={5: 100.5}),
        lambda: SamplingParams(logit_bias={5: float("nan")}),
        lambda: SamplingParams(logit_bias={-1: 1.0}),
        lambda: SamplingParams(logit_bias={"five": 1.0}),
        lambda: SamplingParams(logit_bias=[(5, 1.0), (5, 2.0)]),
        lambda: SamplingParams(logit_bias={i: 1.0 for i in range(1025)}),
    ],
)
def test_bad_sampling_params_raise(make):
    with pytest.raises(ValueError) as info:
        make()
    assert ":" in str(info.value)  # names the field


def test_logit_bias_is_a_mapping_or_pairs_of_token_ids():
    want = ((3, -2.0), (5, 1.0))
    assert SamplingParams(logit_bias={"5": 1, 3: -2}).logit_bias == want
    assert SamplingParams(logit_bias=[[5, 1.0], (3, -2)]).logit_bias == want


def test_logit_bias_forbids_and_forces_tokens(llm):
    """-100 keeps a token from ever being sampled, +100 makes it the only one; the rows of the
    batch without a bias answer as they do alone."""
    prompts = random_prompts(3, 384, seed=8)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    free = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    banned = set(free[0])
    ban = SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, logit_bias={t: -100.0 for t in banned}
    )
    force = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, logit_bias={7: 100})
    out = [o["token_ids"] for o in llm.generate(prompts, [ban, force, greedy], use_tqdm=False)]
    assert len(out[0]) == 8 and not banned & set(out[0]), (banned, out[0])
    assert out[1] == [7] * 8
    assert out[2] == free[2]
    assert_kv_clean(llm)


def test_bad_prompts_raise_and_leave_nothing_allocated(llm):
    good = random_prompts(2, 384, seed=7)
    too_long = [5] * 512
    cases = [
        ([[]], SamplingParams(max_tokens=4), "prompt"),
        ([too_long], SamplingParams(max_tokens=4), "context"),
        ([good[0]], SamplingParams(max_tokens=600), "max_tokens"),
        ([[1, 2, 99999]], SamplingParams(max_tokens=4), "token ids"),
        ([good[0]], SamplingParams(max_tokens=4, logit_bias={99999: 1.0}), "logit_bias"),
    ]
    for prompts, params, word in cases:
        with pytest.raises(InvalidRequestError, match=word):
            llm.generate(good + prompts, params, use_tqdm=False)
        assert_kv_clean(llm)
    assert len(llm.generate(good, SamplingParams(max_tokens=3), use_tqdm=False)) == 2


def test_bad_models_raise(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ModelNotFoundError, match="gguf"):
        LLM(str(tmp_path / "weights.bin"))
    cfg_dir = tmp_path / "alien"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").write_text(json.dumps({"architectures": ["AlienForCausalLM"]}))
    with pytest.raises(ValueError, match="AlienForCausalLM"):
        LLM(str(cfg_dir))
    with pytest.raises(ValueError, match="unknown options"):
        LLM(str(cfg_dir), colour="blue")
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(cfg_dir), dtype="int3")
