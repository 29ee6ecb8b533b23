"""One choice's chat output split three ways: reasoning, content and tool calls."""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl.tokenizer.parsers.base import CallFragment, ParsedCall, ParsedDelta, ToolCallParser
from minisgl.tokenizer.parsers.reasoning import ReasoningSplitter


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)  # completed by this piece
    fragments: list[CallFragment] = field(default_factory=list)  # of calls being written

    def __iadd__(self, other: ChatDelta) -> ChatDelta:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls
        self.fragments += other.fragments
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
        if self.reasoning is None:
            return self._answer("", text, final=False)
        r = self.reasoning.feed(text)
        return self._answer(r.reasoning, r.content, final=False)

    def finish(self) -> ChatDelta:
        out = ChatDelta()
        if self.reasoning is not None:
            r = self.reasoning.finish()
            out += self._answer(r.reasoning, r.content, final=False)
        out += self._answer("", "", final=True)
        return out

    def _answer(self, reasoning: str, content: str, final: bool) -> ChatDelta:
        if self.tools is None:
            return ChatDelta(reasoning, content)
        d = self.tools.feed(content) if content else ParsedDelta()
        if final:
            d += self.tools.finish()
        return self._with_calls(reasoning, d)

    def _with_calls(self, reasoning: str, d: ParsedDelta) -> ChatDelta:
        self.num_calls += len(d.calls)
        return ChatDelta(reasoning, d.content, d.calls, d.fragments)

    def parse(self, text: str) -> ChatDelta:
        """A whole output at once."""
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(text)
        else:
            reasoning = ""
        if self.tools is None:
            return ChatDelta(reasoning, text)
        return self._with_calls(reasoning, self.tools.parse(text))
