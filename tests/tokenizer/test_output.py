"""The output pipeline (`RequestOutput`) with the real SmolLM2 tokenizer: examples of each rule,
and a property test over random token streams against decoding whole prefixes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.tokenizer.output import (
    OutputDelta,
    OutputOptions,
    OutputParser,
    ParsedText,
    RequestOutput,
)

FFFD = "\ufffd"
EOS = 2  # <|im_end|>


def run(pipe: RequestOutput, events: list[list[int]], reason: str = "length") -> list[OutputDelta]:
    """Feed `events` (the last one finishes the request with `reason`); the deltas returned."""
    deltas = []
    for i, ids in enumerate(events):
        last = i == len(events) - 1
        d = pipe.add(ids, last, reason if last else None, [float(t) for t in ids])
        if d is not None:
            deltas.append(d)
    return deltas


def joined(deltas: list[OutputDelta]) -> tuple[str, list[int]]:
    return "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids]


def ids_of(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text)["input_ids"])


# ---- the rules, one example each ---------------------------------------------------------------


def test_a_stop_string_split_across_tokens_ends_the_answer_at_its_token(tokenizer: Any) -> None:
    ids = ids_of(tokenizer, "The capital of France is Paris, a city")
    stop = "e is Par"  # spans " France", " is", " Paris"
    pipe = RequestOutput(tokenizer, OutputOptions(stop=(stop,)))
    deltas = run(pipe, [[t] for t in ids])
    text, kept = joined(deltas)
    paris = next(k for k in range(len(ids)) if "Par" in tokenizer.decode(ids[: k + 1]))
    assert text == "The capital of Franc"
    assert kept == ids[: paris + 1]  # the tokens after the one completing it are dropped
    last = deltas[-1]
    assert (last.finished, last.finish_reason, last.matched_stop) == (True, "stop", stop)
    assert last.completion_tokens == paris + 1 and last.abort
    assert [d.abort for d in deltas].count(True) == 1
    assert [lp for d in deltas for lp in d.logprobs] == [float(t) for t in kept]
    assert pipe.add([5], True, "abort") is None  # the scheduler's late tokens and its end


def test_include_stop_str_in_output_keeps_it(tokenizer: Any) -> None:
    ids = ids_of(tokenizer, "one, two, three, four")
    pipe = RequestOutput(tokenizer, OutputOptions(stop=(", th",), include_stop_str_in_output=True))
    text, _ = joined(run(pipe, [[t] for t in ids]))
    assert text == "one, two, th"


def test_a_stop_completed_by_the_last_allowed_token_is_stop(tokenizer: Any) -> None:
    ids = ids_of(tokenizer, "one, two, three")
    pipe = RequestOutput(tokenizer, OutputOptions(stop=("three",)))
    deltas = run(pipe, [[t] for t in ids], reason="length")  # max_tokens == len(ids)
    assert deltas[-1].finish_reason == "stop" and deltas[-1].matched_stop == "three"
    assert not any(d.abort for d in deltas)  # the scheduler finished it already
    assert joined(deltas) == ("one, two, ", ids)


@pytest.mark.parametrize("skip", [True, False])
def test_a_stop_token_is_kept_and_counted_but_not_text(tokenizer: Any, skip: bool) -> None:
    ids = ids_of(tokenizer, "Hi there") + [EOS]
    pipe = RequestOutput(tokenizer, OutputOptions(skip_special_tokens=skip))
    deltas = run(pipe, [ids[:1], ids[1:]], reason="stop")
    assert joined(deltas) == ("Hi there", ids)
    assert deltas[-1].matched_stop == EOS and deltas[-1].completion_tokens == len(ids)
    kept = RequestOutput(
        tokenizer, OutputOptions(skip_special_tokens=skip, include_stop_str_in_output=True)
    )
    text, _ = joined(run(kept, [ids], reason="stop"))
    assert text == "Hi there" + ("" if skip else "<|im_end|>")


def test_special_tokens_are_text_when_not_skipped(tokenizer: Any) -> None:
    ids = ids_of(tokenizer, "a") + [EOS] + ids_of(tokenizer, "b c")
    for skip, text in ((True, "ab c"), (False, "a<|im_end|>b c")):
        assert (
            joined(run(RequestOutput(tokenizer, OutputOptions(skip_special_tokens=skip)), [ids]))[0]
            == text
        )
    pipe = RequestOutput(tokenizer, OutputOptions(stop=("end|>b",), skip_special_tokens=False))
    assert joined(run(pipe, [[t] for t in ids])) == ("a<|im_", ids[:3])


def test_min_tokens_ignores_stop_strings_completed_before_it(tokenizer: Any) -> None:
    ids = ids_of(tokenizer, "a, b, c, d")  # a , b , c , d: one token each
    assert len(ids) == 7
    pipe = RequestOutput(tokenizer, OutputOptions(stop=(",",), min_tokens=3))
    deltas = run(pipe, [[t] for t in ids])
    # The comma of token 2 comes within the first 3 tokens and does not count; token 4's does.
    assert joined(deltas) == ("a, b", ids[:4])
    assert deltas[-1].completion_tokens == 4


def test_min_tokens_still_holds_back_a_possible_stop_start(tokenizer: Any) -> None:
    ids = ids_of(tokenizer, "xx ab cd")
    pipe = RequestOutput(tokenizer, OutputOptions(stop=(" ab c",), min_tokens=2))
    deltas = run(pipe, [[t] for t in ids])
    assert deltas[-1].matched_stop == " ab c" and joined(deltas)[0] == "xx"


def test_an_incomplete_character_is_flushed_at_the_end(tokenizer: Any) -> None:
    ids = ids_of(tokenizer, "ok 😀")[:-1]  # the emoji's last byte never comes
    pipe = RequestOutput(tokenizer, OutputOptions(stop=("zz",)))
    deltas = run(pipe, [[t] for t in ids], reason="length")
    assert joined(deltas)[0] == tokenizer.decode(ids) and joined(deltas)[0].endswith(FFFD)


def test_abort_releases_the_held_text(tokenizer: Any) -> None:
    ids = ids_of(tokenizer, "one two")
    pipe = RequestOutput(tokenizer, OutputOptions(stop=("two!",)))
    d = pipe.add(ids, False, None)
    assert d is not None and d.text == "one "  # "two" may begin "two!"
    d = pipe.add([], True, "abort")
    assert d is not None and (d.text, d.finish_reason, d.matched_stop) == ("two", "abort", None)
    assert d.completion_tokens == len(ids)


def test_without_a_tokenizer_ids_and_counts_still_come_out() -> None:
    pipe = RequestOutput(None, OutputOptions())
    deltas = run(pipe, [[5, 6], [7, EOS]], reason="stop")
    assert joined(deltas) == ("", [5, 6, 7, EOS])
    assert deltas[-1].matched_stop == EOS and deltas[-1].completion_tokens == 4
    with pytest.raises(ValueError, match="stop"):
        RequestOutput(None, OutputOptions(stop=("x",)))


class _Shouting(OutputParser):
    """A parser of the test's own: content in upper case; the number of deltas as a field."""

    def __init__(self) -> None:
        self.calls = 0

    def feed(self, text: str) -> ParsedText:
        self.calls += 1
        return ParsedText(text.upper())

    def finish(self) -> ParsedText:
        return ParsedText("!", {"deltas": self.calls})


def test_an_output_parser_gets_the_cut_text_and_the_end(tokenizer: Any) -> None:
    ids = ids_of(tokenizer, "hello world, and more")
    pipe = RequestOutput(tokenizer, OutputOptions(stop=(",",)), parser=_Shouting())
    deltas = run(pipe, [[t] for t in ids])
    assert joined(deltas)[0] == "HELLO WORLD!"
    assert deltas[-1].fields == {"deltas": 2}


# ---- property: random token streams against decoding whole prefixes -----------------------------


@dataclass
class Expected:
    text: str
    ids: list[int]
    reason: str
    matched: str | int | None
    stop_token: int | None  # the index (1-based) of the token that completed a stop string


def reference(
    tokenizer: Any,
    ids: list[int],
    reason: str,
    stops: list[str],
    skip: bool,
    min_tokens: int,
    include: bool,
) -> Expected:
    """The answer written the plain way: decode every prefix of the ids whole; the text after
    k tokens is the decode of the longest prefix (of at most k) that does not end in an
    incomplete character (U+FFFD), and all of it once the request ended. The first k > min_tokens
    whose text holds a stop string ending after the text of the first min_tokens tokens ends
    the answer, at the earliest such stop (the shorter on a tie)."""
    stop_id = ids[-1] if reason == "stop" and ids else None
    text_ids = ids[:-1] if stop_id is not None and not include else ids
    n = len(text_ids)

    def visible(k: int) -> str:
        if k >= n:
            return str(tokenizer.decode(text_ids, skip_special_tokens=skip))
        for j in range(k, 0, -1):
            t = str(tokenizer.decode(text_ids[:j], skip_special_tokens=skip))
            if not t.endswith(FFFD):
                return t
        return ""

    boundary = len(visible(min_tokens))
    for k in range(min_tokens + 1, n + 1):
        text = visible(k)
        hits = [(text.find(s, max(0, boundary - len(s) + 1)), s) for s in stops]
        found = [(i, s) for i, s in hits if i >= 0]
        if found:
            start, s = min(found, key=lambda h: (h[0], len(h[1])))
            return Expected(text[: start + len(s) if include else start], ids[:k], "stop", s, k)
    return Expected(visible(n), ids, reason, stop_id, None)


def token_ids(tokenizer: Any) -> st.SearchStrategy[int]:
    """Special tokens, single bytes (incomplete characters), anything in the vocabulary, and
    the tokens of text with multi-byte characters."""
    texts = ["😀 ok 🎉", "日本語", "héllo wörld", "a, b. c\n\n"]
    return st.one_of(
        st.integers(0, 16),
        st.integers(17, 290),
        st.integers(0, len(tokenizer) - 1),
        st.sampled_from([t for text in texts for t in ids_of(tokenizer, text)]),
    )


@st.composite
def stop_strings(draw: st.DrawFn, text: str) -> list[str]:
    """Pieces of the text (so that they match, often across tokens) and strings that don't."""
    pieces = []
    for _ in range(draw(st.integers(0, 3))):
        if text and draw(st.integers(0, 3)):
            start = draw(st.integers(0, len(text) - 1))
            pieces.append(text[start : start + draw(st.integers(1, 6))])
        else:
            pieces.append(draw(st.text("ab,. \n😀<|>", min_size=1, max_size=4)))
    return pieces


@st.composite
def chunks(draw: st.DrawFn, ids: list[int]) -> list[list[int]]:
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(ids) - 1)), max_size=len(ids))))
    bounds = [0, *[c for c in cuts if c < len(ids)], len(ids)]
    return [ids[a:b] for a, b in zip(bounds, bounds[1:]) if b > a] or [[]]


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_random_token_streams_equal_the_plain_reference(tokenizer: Any, data: Any) -> None:
    ids = data.draw(st.lists(token_ids(tokenizer), min_size=1, max_size=24), label="ids")
    reason = data.draw(st.sampled_from(["length", "stop", "abort"]), label="reason")
    skip = data.draw(st.booleans(), label="skip")
    include = data.draw(st.booleans(), label="include")
    min_tokens = data.draw(st.just(0) | st.integers(0, len(ids) + 1), label="min_tokens")
    full = str(tokenizer.decode(ids, skip_special_tokens=skip))
    stops = data.draw(stop_strings(full), label="stops")
    events = data.draw(chunks(ids), label="events")
    opts = OutputOptions(tuple(stops), skip, min_tokens, include)
    pipe = RequestOutput(tokenizer, opts)
    deltas, finals = [], []
    for i, chunk in enumerate(events):
        last = i == len(events) - 1 and reason != "abort"
        d = pipe.add(chunk, last, reason if last else None, [float(t) for t in chunk])
        if d is not None:
            deltas.append(d)
            finals.append(last)
    if reason == "abort":
        d = pipe.add([], True, "abort")
        if d is not None:
            deltas.append(d)
            finals.append(True)
    exp = reference(tokenizer, ids, reason, stops, skip, min_tokens, include)
    text, kept = joined(deltas)
    assert (text, kept) == (exp.text, exp.ids)
    end = deltas[-1]
    assert (end.finished, end.finish_reason, end.matched_stop) == (True, exp.reason, exp.matched)
    assert not any(d.finished for d in deltas[:-1])
    assert end.completion_tokens == len(exp.ids)
    assert [lp for d in deltas for lp in d.logprobs] == [float(t) for t in exp.ids]
    # An abort goes to the scheduler exactly when a stop string ended a request it still runs.
    assert [d.abort for d in deltas[:-1]] == [False] * (len(deltas) - 1)
    assert end.abort == (exp.stop_token is not None and not finals[-1])
    if exp.stop_token is None:
        # Nothing invented: a U+FFFD only where decoding the kept ids whole gives one (a stop
        # token left out of the text can leave an incomplete character at its end).
        kept_ids = ids[:-1] if reason == "stop" and not include else ids
        assert FFFD not in text or FFFD in str(tokenizer.decode(kept_ids, skip_special_tokens=skip))
