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
    match can only begin inside the held-back tail plus the newly fed text.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns the text safe to emit and whether a stop string matched (then the text is
        everything before it, and the request is over)."""
        if not self.stops:
            return text, False
        pending = self._held + text
        hits = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return pending[: min(hits)], True
        keep = self._partial_match_len(pending)
        self._held = pending[len(pending) - keep :]
        return pending[: len(pending) - keep], False

    def flush(self) -> str:
        """The held-back tail: the request ended without completing a stop string."""
        out, self._held = self._held, ""
        return out

    def _partial_match_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
