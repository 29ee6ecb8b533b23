"""The thinking part of a reasoning model's output, split from its answer.

- qwen3: thinking is `<think>...</think>` at the start of the output; an output that does not
  open with `<think>` (thinking turned off) is all answer.
- deepseek-r1: the chat template opens `<think>` in the prompt, so the output is thinking up to
  `</think>` (a `<think>` the model repeats is dropped).
"""

from __future__ import annotations

from typing import NamedTuple

from minisgl.config import REASONING_PARSERS
from minisgl.tokenizer.parsers.base import held_prefix

THINK_START, THINK_END = "<think>", "</think>"


class ReasoningDelta(NamedTuple):
    reasoning: str
    content: str


class ReasoningSplitter:
    """One choice's output, fed piece by piece: which of it is thinking and which answer."""

    def __init__(self, parser: str, thinking: bool = True) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning parser {parser!r}; one of {', '.join(REASONING_PARSERS)}"
            )
        # deepseek-r1 starts inside the thinking part; qwen3 waits for the opening tag.
        self._opens_in_prompt = parser == "deepseek-r1" and thinking
        self._state = "start" if thinking else "answer"  # | "thinking"
        self._buf = ""
        self._strip_next = False  # the blanks after `</think>` belong to neither part

    def feed(self, text: str) -> ReasoningDelta:
        self._buf += text
        reasoning = content = ""
        if self._state == "start":
            self._open()
        if self._state == "thinking":
            i = self._buf.find(THINK_END)
            if i < 0:
                keep = held_prefix(self._buf, THINK_END)
                reasoning, self._buf = (
                    self._buf[: len(self._buf) - keep],
                    self._buf[len(self._buf) - keep :],
                )
                return ReasoningDelta(reasoning, "")
            reasoning, self._buf = self._buf[:i], self._buf[i + len(THINK_END) :]
            self._state, self._strip_next = "answer", True
        if self._state == "answer":
            if self._strip_next:
                self._buf = self._buf.lstrip()
                self._strip_next = not self._buf
            content, self._buf = self._buf, ""
        return ReasoningDelta(reasoning, content)

    def _open(self) -> None:
        head = self._buf.lstrip()
        if head.startswith(THINK_START):
            self._buf, self._state = head[len(THINK_START) :], "thinking"
        elif not head or THINK_START.startswith(head):
            return  # wait: the tag may be coming
        else:
            self._state = "thinking" if self._opens_in_prompt else "answer"

    def finish(self) -> ReasoningDelta:
        """What is held at the end of the output."""
        text, self._buf = self._buf, ""
        if self._state == "thinking" or (self._state == "start" and self._opens_in_prompt):
            return ReasoningDelta(text, "")
        return ReasoningDelta("", text.lstrip() if self._strip_next else text)

    def split(self, text: str) -> ReasoningDelta:
        """A whole output at once."""
        a, b = self.feed(text), self.finish()
        return ReasoningDelta(a.reasoning + b.reasoning, a.content + b.content)
