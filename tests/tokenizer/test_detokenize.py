"""Incremental detokenisation and stop strings with the real SmolLM2 tokenizer."""

from __future__ import annotations

from typing import Any

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from minisgl.message import TokenOut
from minisgl.tokenizer.output import IncrementalDetokenizer, StopMatcher
from minisgl.tokenizer.workers import Detokenizer

# Characters the byte-level BPE splits across several tokens (emoji, CJK, accents).
TEXTS = [
    "😀 ok 🎉🎉",
    "日本語のテキスト",
    "héllo wörld naïve café",
    "a\u200db  \n\t x",
    "Ünïcödé → ∑",
]


def feed(tokenizer: Any, ids: list[int], chunk: int = 1) -> list[str]:
    d = IncrementalDetokenizer(tokenizer)
    deltas = [d.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas + [d.flush()]


def test_multibyte_characters_are_never_split(tokenizer: Any) -> None:
    split = 0
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        split += sum("\ufffd" in tokenizer.decode([i]) for i in ids)
        deltas = feed(tokenizer, ids)
        assert all("\ufffd" not in d for d in deltas), deltas
        assert "".join(deltas) == text
    assert split > 0  # some characters do span tokens, else this proves nothing


def test_split_character_waits_for_its_last_byte(tokenizer: Any) -> None:
    ids = tokenizer("😀")["input_ids"]
    assert len(ids) > 1  # one emoji, several byte tokens
    d = IncrementalDetokenizer(tokenizer)
    assert [d.add([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.add(ids[-1:]) == "😀"


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(
        st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=40
    ),
    chunk=st.integers(1, 4),
)
def test_deltas_join_to_the_full_decode(tokenizer: Any, text: str, chunk: int) -> None:
    ids = tokenizer(text)["input_ids"]
    deltas = feed(tokenizer, ids, chunk)
    assert "".join(deltas) == tokenizer.decode(ids)
    if "\ufffd" not in tokenizer.decode(ids):
        assert all("\ufffd" not in d for d in deltas[:-1])


def test_stop_matcher_holds_back_partial_matches() -> None:
    m = StopMatcher(["STOP!"])
    assert m.feed("abc ST") == ("abc ", None)
    assert m.feed("O") == ("", None)
    assert m.feed("X and") == ("STOX and", None)  # not a stop after all: released
    assert m.feed(" ST") == (" ", None)
    assert m.feed("OP! tail") == ("", "STOP!")


def test_stop_matcher_cuts_at_the_earliest_stop() -> None:
    m = StopMatcher(["world", "lo w"])
    assert m.feed("hello world") == ("hel", "lo w")


def test_stop_matcher_can_keep_the_stop_string() -> None:
    m = StopMatcher(["lo w", "world"], include_stop=True)
    assert m.feed("hel") == ("he", None)  # "l" may begin "lo w"
    assert m.feed("lo world") == ("llo w", "lo w")  # "he" + "llo w": through the stop


def test_stop_matcher_without_check_holds_back_but_never_matches() -> None:
    # min_tokens not reached: a complete stop string is released, a possible start held back.
    m = StopMatcher(["ab"])
    assert m.feed("xaba", check=False) == ("xab", None)
    assert m.feed("b", check=True) == ("", "ab")  # completed by new text: it counts
    m = StopMatcher(["ab", "xabz"])
    assert m.feed("xab", check=False) == ("", None)  # all of it may begin "xabz"
    # "ab" ended before the check started, so only a stop ending in the new text counts.
    assert m.feed("q", check=True) == ("xabq", None)


def test_stop_matcher_flush_releases_the_tail() -> None:
    m = StopMatcher(["\n\n"])
    assert m.feed("line\n") == ("line", None)
    assert m.flush() == "\n"


@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.text("ab\n", max_size=4), max_size=8),
    stops=st.lists(st.text("ab\n", min_size=1, max_size=3), min_size=1, max_size=3),
)
def test_stop_matcher_equals_cutting_the_whole_text(pieces: list[str], stops: list[str]) -> None:
    # A stop inside a longer one ('b' in '\nbb') can complete first while the longer one
    # started earlier; streaming rightly cuts at the one that completed, which this oracle
    # (earliest start in the whole text) does not model. Without nesting the two agree.
    assume(not any(a != b and a in b for a in stops for b in stops))
    m = StopMatcher(stops)
    emitted, matched = "", False
    for p in pieces:
        out, stop = m.feed(p)
        emitted += out
        matched = stop is not None
        if matched:
            break
    if not matched:
        emitted += m.flush()
    text = "".join(pieces)
    hits = [text.find(s) for s in stops if s in text]
    assert matched == bool(hits)
    assert emitted == (text[: min(hits)] if hits else text)


def token_out(
    rid: str, ids: list[int], stop: list[str], finished: bool = False, reason: str | None = None
) -> TokenOut:
    return TokenOut(
        rid,
        ids,
        finished,
        reason,
        prompt_tokens=3,
        cached_tokens=0,
        stop=stop,
        skip_special_tokens=True,
    )


def test_stop_string_spanning_tokens_cuts_and_aborts(tokenizer: Any) -> None:
    text = "The capital of France is Paris, a city"
    ids = tokenizer(text)["input_ids"]
    stop = ["e is Par"]  # spans " France", " is", " Paris"
    d = Detokenizer(tokenizer)
    streamed, aborts, final = "", [], None
    for i, t in enumerate(ids):
        out, abort = d.process(token_out("r", [t], stop))
        aborts.append(abort)
        if out is not None:
            streamed += out.text
            if out.finished:
                final = out
                assert abort and out.finish_reason == "stop"
                assert out.completion_tokens == i + 1
                break
    assert final is not None
    assert streamed == "The capital of Franc"
    assert aborts.count(True) == 1
    # Tokens the scheduler computed before the abort landed are dropped, then the rid is gone.
    assert d.process(token_out("r", [ids[-1]], stop)) == (None, False)
    assert d.process(token_out("r", [], stop, finished=True, reason="abort")) == (None, False)
    assert "r" not in d.states


def test_eos_text_is_not_part_of_the_answer(tokenizer: Any) -> None:
    d = Detokenizer(tokenizer)
    ids = tokenizer("Hi there")["input_ids"]
    d.process(token_out("r", ids, []))
    out, _ = d.process(
        TokenOut(
            "r", [tokenizer.convert_tokens_to_ids(".")], True, "stop", 3, 0, [], False, 0, False
        )
    )
    assert out is not None and out.finished and out.text == ""  # the stop token is cut
    assert out.completion_tokens == len(ids) + 1


def test_finished_request_flushes_held_text(tokenizer: Any) -> None:
    d = Detokenizer(tokenizer)
    ids = tokenizer("one two")["input_ids"]
    out, _ = d.process(token_out("r", ids, ["two!"]))
    assert out is not None and out.text == "one "  # "two" may begin "two!"
    out, _ = d.process(token_out("r", [], ["two!"], finished=True, reason="length"))
    assert out is not None and out.text == "two" and out.finish_reason == "length"


def test_logprob_tokens_are_named(tokenizer: Any) -> None:
    d = Detokenizer(tokenizer)
    ids = tokenizer(" Paris")["input_ids"]
    out = TokenOut(
        "r",
        ids,
        False,
        None,
        3,
        0,
        [],
        True,
        logprobs=[-0.5],
        top_ids=[[ids[0], 13]],
        top_logprobs=[[-0.5, -2.0]],
    )
    text_out, _ = d.process(out)
    assert text_out is not None
    lp = text_out.logprobs[0]
    assert (lp.token, lp.token_id, lp.logprob) == (" Paris", ids[0], -0.5)
    assert [t.logprob for t in lp.top] == [-0.5, -2.0]
    assert lp.top[1].token == tokenizer.decode([13])
