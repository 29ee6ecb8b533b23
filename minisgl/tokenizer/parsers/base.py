"""The contract of a tool-call parser, and what it returns."""

from __future__ import annotations

import json
import secrets
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ParsedCall:
    """One complete function call the model wrote; `arguments` is JSON text."""

    index: int  # its place among the choice's calls
    id: str
    name: str
    arguments: str


@dataclass
class ParsedDelta:
    """What one piece of output adds: plain content and calls completed by it."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)

    def __iadd__(self, other: ParsedDelta) -> ParsedDelta:
        self.content += other.content
        self.calls += other.calls
        return self


class ToolCallParser(ABC):
    """Splits one choice's output into content and tool calls, fed piece by piece (a stream) or
    all at once. Text that looks like a call but does not parse as one is given back as
    content: a model's malformed call never becomes an error.

    `feed` may hold text back while it cannot tell yet (a tag's first characters, a call still
    being written); `finish` gives back whatever is held."""

    ID_ALPHABET = string.ascii_letters + string.digits
    ID_LENGTH = 24

    def __init__(self) -> None:
        self.num_calls = 0

    @abstractmethod
    def feed(self, text: str) -> ParsedDelta: ...

    @abstractmethod
    def finish(self) -> ParsedDelta: ...

    def parse(self, text: str) -> ParsedDelta:
        """A whole output at once."""
        out = self.feed(text)
        out += self.finish()
        return out

    def new_call(self, name: str, arguments: Any) -> ParsedCall:
        """The next call of this choice, with a fresh id."""
        text = (
            arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        )
        call = ParsedCall(self.num_calls, self.new_id(), name, text)
        self.num_calls += 1
        return call

    def new_id(self) -> str:
        return "call_" + "".join(secrets.choice(self.ID_ALPHABET) for _ in range(self.ID_LENGTH))


def held_prefix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that `tag` starts with (text to hold back, as
    the next piece may complete the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
