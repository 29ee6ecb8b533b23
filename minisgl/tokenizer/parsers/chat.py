"""One choice's chat output split three ways: reasoning, content and tool calls."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from minisgl.tokenizer.parsers.base import ParsedDelta, ToolCallParser
from minisgl.tokenizer.parsers.reasoning import ReasoningDelta, ReasoningSplitter


@dataclass
class ChatDelta(ParsedDelta):
    reasoning: str = ""

    def __iadd__(self, other: ParsedDelta) -> ChatDelta:
        super().__iadd__(other)
        self.reasoning += other.reasoning if isinstance(other, ChatDelta) else ""
        return self

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls or self.fragments)


class ChatOutputParser:
    """The thinking part is split off first (`reasoning`), then the tool calls are parsed
    from the rest (`tools`); either may be None (that split is not made)."""

    def __init__(self, tools: ToolCallParser | None, reasoning: ReasoningSplitter | None) -> None:
        self.tools = tools
        self.reasoning = reasoning
        self.num_calls = 0

    def feed(self, text: str) -> ChatDelta:
        r = self.reasoning.feed(text) if self.reasoning else ReasoningDelta("", text)
        return self._answer(r, final=False)

    def finish(self) -> ChatDelta:
        """What is held at the end of the output."""
        r = self.reasoning.finish() if self.reasoning else ReasoningDelta("", "")
        return self._answer(r, final=True)

    def parse(self, text: str) -> ChatDelta:
        """A whole output at once."""
        r = self.reasoning.split(text) if self.reasoning else ReasoningDelta("", text)
        return self._answer(r, final=True, read=self.tools.parse if self.tools else None)

    def _answer(
        self, r: ReasoningDelta, final: bool, read: Callable[[str], ParsedDelta] | None = None
    ) -> ChatDelta:
        """The thinking `r` split off, the calls parsed from its answer (`read`, default: fed
        to the call parser, which ends with it when `final`)."""
        if self.tools is None:
            return ChatDelta(r.content, reasoning=r.reasoning)
        if read is not None:
            d = read(r.content)
        else:
            d = self.tools.feed(r.content) if r.content else ParsedDelta()
            if final:
                d += self.tools.finish()
        self.num_calls += len(d.calls)
        return ChatDelta(d.content, d.calls, d.fragments, r.reasoning)
