"""Messages survive msgpack encoding as the same dataclasses."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.core import SamplingParams
from minisgl.message import (
    AbortReq,
    ChatMessage,
    DecodeError,
    DetokOut,
    EngineInfo,
    FlushCacheOut,
    FlushCacheReq,
    GenerateReq,
    RequestError,
    SchedulerOut,
    SchedulerStats,
    StrOut,
    TokenizedReq,
    TokenLogprob,
    TokenOut,
    TopLogprob,
    decode,
    encode,
)

STATS = SchedulerStats(1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
EXAMPLES = [
    GenerateReq(
        ["a"],
        [1],
        SamplingParams(stop=["x", "y"], top_k=5, min_tokens=3, include_stop_str_in_output=True),
        12,
        messages=[ChatMessage("user", "hé 😀")],
    ),
    GenerateReq(["a", "b"], [-(2**63), 2**63 - 1], SamplingParams(), None, input_ids=[1, 2]),
    TokenizedReq("r", [1, 2, 3], SamplingParams(stop_token_ids=[4], logprobs=True), 3),
    AbortReq("r"),
    FlushCacheReq(7),
    FlushCacheOut(7, 3),
    SchedulerOut(
        [
            TokenOut(
                "r",
                [5],
                True,
                "stop",
                3,
                1,
                ["\n"],
                True,
                2,
                True,
                [-0.1],
                [[5, 6]],
                [[-0.1, -2.5]],
            )
        ],
        STATS,
    ),
    DetokOut(
        [
            StrOut(
                "r",
                "hi",
                [5],
                False,
                None,
                3,
                1,
                1,
                [TokenLogprob("hi", 5, -0.1, [TopLogprob("hi", -0.1)])],
            ),
            StrOut("r", "", [2], True, "stop", 3, 1, 2, matched_stop=2),
            StrOut("s", "a", [7], True, "stop", 3, 1, 1, matched_stop="\n\n"),
        ],
        STATS,
    ),
    RequestError(["a", "b"], "prompt: too long", "prompt", 400),
    EngineInfo("m", 8192, 100, 1, 49152),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: object) -> None:
    assert decode(encode(msg)) == msg


@settings(max_examples=100)
@given(
    rid=st.text(max_size=8),
    ids=st.lists(st.integers(0, 2**31), max_size=5),
    stop=st.lists(st.text(max_size=4), max_size=3),
    min_tokens=st.integers(0, 2**31 - 1),
    lps=st.lists(st.floats(allow_nan=False), max_size=3),
)
def test_token_out_round_trip(
    rid: str, ids: list[int], stop: list[str], min_tokens: int, lps: list[float]
) -> None:
    out = TokenOut(rid, ids, False, None, 1, 0, stop, True, min_tokens, True, lps)
    assert decode(encode(out)) == out


def test_unregistered_types_are_refused() -> None:
    @dataclasses.dataclass
    class Stranger:
        x: int

    with pytest.raises(TypeError, match="Stranger"):
        encode(Stranger(1))


def test_unknown_codes_are_refused() -> None:
    import msgpack

    with pytest.raises(DecodeError):
        decode(msgpack.packb(msgpack.ExtType(99, b"\x90")))
