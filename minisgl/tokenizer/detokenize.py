"""Incremental detokenisation and stop strings, one request at a time (pure logic, no I/O)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
