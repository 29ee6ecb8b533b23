"""The one output pipeline: a request's token events in; text deltas, stop-string finishes,
finish reason, the stop that matched, usage and log-probs out. The server's detokenizer worker
and the offline `LLM` both run it, so a request answers the same through either front door.

Its semantics are vLLM's, as the README's "Output semantics" states them. Two follow from
how the engine runs: the tokens after the one that completes a stop string are dropped (with
overlap scheduling the scheduler computes one or more before the abort reaches it), and stop
tokens cannot be sampled before `min_tokens` (the sampler's `StopMask`), while stop strings
before it are only held back. The answer's text then passes through an `OutputParser` (the
default leaves it as it is): the place where tool-call and reasoning parsers plug in.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from minisgl.core import FinishReason, SamplingParams

_STOP = FinishReason.STOP.value


# ---- incremental detokenisation and stop strings -------------------------------------------------
# Incremental detokenisation and stop strings, one request at a time (pure logic, no I/O).
# A byte-level tokenizer decodes an incomplete UTF-8 sequence to U+FFFD.
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas that never split a character.

    Each call decodes only a short window: the ids since the last emitted delta, plus the ids of
    that delta as context (tokenizers that merge spaces need the neighbour to decode a token).
    A window whose text ends in U+FFFD is an incomplete character; it waits for more ids.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # ids before this are emitted

    def _decode(self, ids: list[int]) -> str:
        text: str = self._tokenizer.decode(ids, skip_special_tokens=self._skip)
        return text

    def add(self, new_ids: Sequence[int]) -> str:
        """Append ids; return the text they complete (maybe empty)."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """The text still held back (the request ended; an incomplete character stays U+FFFD)."""
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self.ids)
        return full[len(prefix) :]


class StopMatcher:
    """Cuts the text at the first stop string and holds back a tail that may begin one.

    Emitted text never contains the start of a stop string that could still complete, so a
    match can only begin inside the held-back tail plus the newly fed text. With
    `include_stop`, the emitted text keeps the stop string that matched.
    """

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self._held = ""

    def feed(self, text: str, check: bool = True) -> tuple[str, str | None]:
        """Returns the text safe to emit and the stop string that matched, if one did (then the
        text ends at it, and the request is over). With `check` False (min_tokens not reached
        yet) stop strings are only held back, never matched."""
        if not self.stops:
            return text, None
        pending = self._held + text
        hit = self._first_hit(pending, len(self._held)) if check else None
        if hit is not None:
            start, stop = hit
            self._held = ""
            return pending[: start + len(stop) if self.include_stop else start], stop
        keep = self._partial_match_len(pending)
        self._held = pending[len(pending) - keep :]
        return pending[: len(pending) - keep], None

    def flush(self) -> str:
        """The held-back tail: the request ended without completing a stop string."""
        out, self._held = self._held, ""
        return out

    def _first_hit(self, pending: str, old: int) -> tuple[int, str] | None:
        """The earliest-starting stop string in `pending` that ends in its new text (after
        `old` characters): one that ended before either matched then or fell before
        min_tokens. Of two starting at one place, the shorter (it completed first)."""
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = pending.find(s, max(0, old - len(s) + 1))
            if i >= 0 and (best is None or (i, len(s)) < (best[0], len(best[1]))):
                best = (i, s)
        return best

    def _partial_match_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best


@dataclass(frozen=True)
class OutputOptions:
    """What the pipeline needs of a request's sampling parameters."""

    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    min_tokens: int = 0
    include_stop_str_in_output: bool = False

    @staticmethod
    def of(params: SamplingParams) -> OutputOptions:
        return OutputOptions(
            params.stop,
            params.skip_special_tokens,
            params.min_tokens,
            params.include_stop_str_in_output,
        )


@dataclass
class ParsedText:
    """What an output parser makes of some text: the part that goes to `content`, and fields
    of its own (a tool parser's `tool_calls`, a reasoning parser's `reasoning_content`)."""

    content: str
    fields: dict[str, Any] = field(default_factory=dict)


class OutputParser(ABC):
    """Turns one request's answer text into content plus extra fields, as it streams.

    `feed` gets each text delta (stop strings already cut) and returns what can be emitted
    now; it may hold text back until it knows what it is. `finish` is called once when the
    request ends and returns whatever is still held.
    """

    @abstractmethod
    def feed(self, text: str) -> ParsedText: ...

    @abstractmethod
    def finish(self) -> ParsedText: ...


class PlainText(OutputParser):
    """The default: all text is content."""

    def feed(self, text: str) -> ParsedText:
        return ParsedText(text)

    def finish(self) -> ParsedText:
        return ParsedText("")


@dataclass
class OutputDelta:
    """What one token event added to a request's answer."""

    text: str  # the parser's content
    token_ids: list[int]  # the event's ids that the answer keeps
    # Per kept token, when the request asked for them (as the scheduler sent them).
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    finished: bool
    finish_reason: str | None  # a FinishReason value once finished
    matched_stop: str | int | None  # the stop string or stop token id that ended it
    completion_tokens: int  # total so far
    # A stop string ended the answer while the scheduler still computes the request: abort it.
    abort: bool
    fields: dict[str, Any] = field(default_factory=dict)  # the parser's extra fields


class RequestOutput:
    """One request's output pipeline (pure logic, no I/O): feed it the request's token events
    in order with `add`.

    Without a tokenizer (a model with token-id prompts only) there is no text and no stop
    strings; ids, finish reason, usage and log-probs still come out.
    """

    def __init__(
        self, tokenizer: Any | None, options: OutputOptions, parser: OutputParser | None = None
    ) -> None:
        if tokenizer is None and options.stop:
            raise ValueError("stop: stop strings need the model's tokenizer")
        self.options = options
        self._decoder = (
            None
            if tokenizer is None
            else IncrementalDetokenizer(tokenizer, options.skip_special_tokens)
        )
        self._stops = StopMatcher(options.stop, options.include_stop_str_in_output)
        self._parser = parser or PlainText()
        self.num_tokens = 0  # tokens kept so far
        self.finished = False

    def add(
        self,
        new_ids: Sequence[int],
        finished: bool,
        finish_reason: str | None,
        logprobs: Sequence[float] = (),
        top_ids: Sequence[list[int]] = (),
        top_logprobs: Sequence[list[float]] = (),
    ) -> OutputDelta | None:
        """The delta of one event: the request gained `new_ids` (their log-probs alongside,
        when asked for); `finished` and `finish_reason` are the scheduler's. None once the
        answer has ended (the ids the scheduler computed before its abort landed)."""
        if self.finished:
            return None
        ids = list(new_ids)
        stop_id = ids[-1] if finished and finish_reason == _STOP and ids else None
        text_ids = ids
        if stop_id is not None and not self.options.include_stop_str_in_output:
            text_ids = ids[:-1]  # the stop token's text is not part of the answer
        text, kept, stop = self._text(text_ids)
        if stop is None and finished:
            tail, stop = self._flush()
            text += tail
        if stop is None:
            self.num_tokens += len(ids) - len(text_ids)  # the stop token, kept and counted
            kept = len(ids)
        self.finished = stop is not None or finished
        parsed = self._parse(text)
        reason = _STOP if stop is not None else finish_reason if finished else None
        return OutputDelta(
            text=parsed.content,
            token_ids=ids[:kept],
            logprobs=list(logprobs[:kept]),
            top_ids=list(top_ids[:kept]),
            top_logprobs=list(top_logprobs[:kept]),
            finished=self.finished,
            finish_reason=reason,
            matched_stop=stop if stop is not None else stop_id,
            completion_tokens=self.num_tokens,
            abort=stop is not None and not finished,
            fields=parsed.fields,
        )

    def _text(self, ids: list[int]) -> tuple[str, int, str | None]:
        """The text `ids` add, how many of them the answer keeps, and the stop string that
        ended it there (None: none did, and all are kept)."""
        decoder = self._decoder
        if decoder is None or not self._stops.stops:
            self.num_tokens += len(ids)
            return ("" if decoder is None else decoder.add(ids)), len(ids), None
        parts = []
        # One id at a time: the token that completes a stop string is the answer's last.
        for k, token in enumerate(ids):
            self.num_tokens += 1
            check = self.num_tokens > self.options.min_tokens
            text, stop = self._stops.feed(decoder.add([token]), check)
            parts.append(text)
            if stop is not None:
                return "".join(parts), k + 1, stop
        return "".join(parts), len(ids), None

    def _flush(self) -> tuple[str, str | None]:
        """The request ended: the text the decoder and the stop matcher held back (an
        incomplete character's U+FFFD may still complete a stop string)."""
        if self._decoder is None:
            return "", None
        check = self.num_tokens > self.options.min_tokens
        text, stop = self._stops.feed(self._decoder.flush(), check)
        return (text, stop) if stop is not None else (text + self._stops.flush(), None)

    def _parse(self, text: str) -> ParsedText:
        parsed = self._parser.feed(text) if text else ParsedText("")
        if self.finished:
            end = self._parser.finish()
            parsed = ParsedText(parsed.content + end.content, {**parsed.fields, **end.fields})
        return parsed
