"""Tool-call parsers of the common open-model formats, and how each format's calls are
written (for the grammar that forces a call).

- Hermes (Qwen2.5, Qwen3, NousHermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one tag per call, anywhere in the output.
- Llama 3.x JSON: `{"name": ..., "parameters": {...}}` as the whole output, after an optional
  `<|python_tag|>`; several calls separated by `;`.
- Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`; the marker is a special
  token, so without it (skip_special_tokens) an output that is such an array counts too.
- DeepSeek-R1 / V3 (`deepseek`): `<｜tool▁calls▁begin｜>`, then per call
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and the arguments in a ```json fence.
- JSON (no parser known): an output that is one call object or an array of them.

Every parser streams a call's arguments as the model writes them (see `ToolCallParser`).
"""

from __future__ import annotations

import re
from abc import abstractmethod
from dataclasses import dataclass

from minisgl.config import TOOL_CALL_PARSERS
from minisgl.tokenizer.parsers.base import CallText, ParsedDelta, ToolCallParser, held_prefix

_ALIASES = {"qwen25": "hermes", "qwen3": "hermes"}


@dataclass(frozen=True)
class CallFormat:
    """How a format writes calls: each call object (`{"name", args_key}`) between `open` and
    `close`, calls joined by `separator`; `array`: all calls are items of one JSON array."""

    name: str
    args_key: str = "arguments"
    open: str = ""
    close: str = ""
    separator: str = ""
    array: bool = False
    call_head: str = ""  # with `{name}`: a call written as head, arguments object, tail
    call_tail: str = ""


FORMATS = {
    "hermes": CallFormat("hermes", open="<tool_call>\n", close="\n</tool_call>", separator="\n"),
    "llama3": CallFormat("llama3", args_key="parameters", separator="; "),
    "mistral": CallFormat("mistral", array=True),
    "json": CallFormat("json", array=True),
    "deepseek": CallFormat(
        "deepseek",
        open="<｜tool▁calls▁begin｜>",
        close="<｜tool▁calls▁end｜>",
        separator="\n",
        call_head="<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n",
        call_tail="\n```<｜tool▁call▁end｜>",
    ),
}


def call_format(parser: str | None) -> CallFormat:
    """The format of `parser`'s calls; bare JSON when no parser is known."""
    return FORMATS[_ALIASES.get(parser, parser)] if parser is not None else FORMATS["json"]


def tool_call_parser(name: str | None) -> ToolCallParser:
    """A fresh parser for one choice (bare JSON calls when `name` is None)."""
    kind = _ALIASES.get(name, name) if name is not None else "json"
    if kind == "hermes":
        return HermesParser()
    if kind == "llama3":
        return JsonCallsParser(markers=("<|python_tag|>",), starts=("{",))
    if kind == "mistral":
        return MistralParser()
    if kind == "json":
        return JsonCallsParser(markers=(), starts=("{", "["))
    if kind == "deepseek":
        return DeepSeekParser()
    raise ValueError(f"unknown tool-call parser {name!r}; one of {', '.join(TOOL_CALL_PARSERS)}")


def detect_tool_call_parser(template: str | None) -> str | None:
    """The parser of the calls a chat template asks its model for, or None when it shows
    none this module knows."""
    if not template:
        return None
    if DeepSeekParser.CALLS_BEGIN in template:
        return "deepseek"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("ipython" in template and "parameters" in template):
        return "llama3"
    return None


_BLANKS = " \t\r\n"


class BlockParser(ToolCallParser):
    """Calls written as one block: the text before it is content; the block holds calls and
    what separates them (blanks, tags, brackets), read by `_between`. A block that breaks
    before any of its calls went out is given back whole as content; after one went out, the
    rest of the block is content."""

    ARGS_KEYS = ("parameters", "arguments")

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""  # text outside a block not given out yet
        self._in_block = False
        self._raw = ""  # the block's text read so far
        self._gap = ""  # text after the last call not read yet
        self._call: CallText | None = None
        self._calls: list[CallText] = []  # the block's

    @abstractmethod
    def _find_block(self, final: bool) -> tuple[str, str | None]:
        """(content before a block, the block's opening tag taken from `_buf` or None when no
        block starts; the rest of `_buf` is then the block's)."""

    @abstractmethod
    def _between(self, final: bool) -> str:
        """Reads `_gap` (with `_consume`): "call" (a call starts: `_start` was called), "wait"
        (more text is needed), "end" (the block is over) or "fail"."""

    def _read(self, text: str, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        while True:
            if not self._in_block:
                self._buf += text
                content, opening = self._find_block(final)
                out.content += content
                if opening is None:
                    if final:
                        out.content, self._buf = out.content + self._buf, ""
                    return out
                text, self._buf = self._buf, ""
                self._in_block, self._raw, self._calls = True, opening, []
            text = self._block(out, text, final)
            if self._in_block:
                return out

    def _block(self, out: ParsedDelta, text: str, final: bool) -> str:
        """The text after the block, once it has ended ("" while it goes on)."""
        while True:
            call = self._call
            if call is not None:
                n = call.feed(text)
                self._raw, text = self._raw + text[:n], text[n:]
                self.stream(out, call)
                if call.broken or final and not call.done:
                    return self._fail(out, text)
                if not call.done:
                    return ""
                if not self.end_call(out, call):
                    return self._fail(out, text)
                self._call = None
            self._gap += text
            step = self._between(final)
            if step == "call":
                text, self._gap = self._gap, ""
            elif step == "wait":
                return ""
            elif step == "end":  # its calls stand, whatever a later block does
                self._in_block, self._mark = False, None
                text, self._gap = self._gap, ""
                return text
            else:
                return self._fail(out, "")

    def _start(self, name: str | None = None) -> None:
        self._call = CallText(self.ARGS_KEYS, name)
        self._calls.append(self._call)

    def _consume(self, n: int) -> None:
        self._raw, self._gap = self._raw + self._gap[:n], self._gap[n:]

    def _fail(self, out: ParsedDelta, following: str) -> str:
        following, self._gap = self._gap + following, ""
        call, self._call = self._call, None
        self._in_block = False
        self._after_fail()
        if not any(c.committed for c in self._calls):
            self.take_back(out, self._raw)
        elif call is not None and call.index is not None:
            self.end_call(out, call)
        elif call is not None:
            out.content += call.text
        return following

    def _after_fail(self) -> None:
        """What a format does once a block broke (the rest of the output is content)."""

    def _find_tag(self, tag: str, final: bool) -> tuple[str, str | None]:
        """`_find_block` for a block that opens with `tag`."""
        i = self._buf.find(tag)
        if i >= 0:
            text, self._buf = self._buf[:i], self._buf[i + len(tag) :]
            return text, tag
        keep = 0 if final else held_prefix(self._buf, tag)
        text, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
        return text, None


class HermesParser(BlockParser):
    """One block per `<tool_call>` tag, anywhere in the output: a call object, then the closing
    tag (or the output's end, when a stop string took it)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    ARGS_KEYS = ("arguments", "parameters")

    def _find_block(self, final: bool) -> tuple[str, str | None]:
        return self._find_tag(self.OPEN, final)

    def _between(self, final: bool) -> str:
        g = self._gap.lstrip(_BLANKS)
        if not self._calls:  # just after the opening tag
            if g.startswith("{"):
                self._consume(len(self._gap) - len(g))
                self._start()
                return "call"
            return "wait" if not g and not final else "fail"
        if g.startswith(self.CLOSE):
            self._consume(len(self._gap) - len(g) + len(self.CLOSE))
            return "end"
        if not final and self.CLOSE.startswith(g):
            return "wait"  # the closing tag may be coming
        return "end" if not g else "fail"


class JsonCallsParser(BlockParser):
    """Calls that make up the rest of the output: after a marker, or when the output starts
    with one of `starts`: call objects separated by blanks, `;` or `,`, or items of arrays."""

    def __init__(self, markers: tuple[str, ...], starts: tuple[str, ...]) -> None:
        super().__init__()
        self.markers = markers
        self.starts = starts
        self._state = "undecided"  # | "content"
        self._brackets = 0

    def _find_block(self, final: bool) -> tuple[str, str | None]:
        if self._state == "undecided":
            head = self._buf.lstrip()
            if any(head.startswith(p) for p in (*self.markers, *self.starts)):
                self._state = "content"  # after the block (which ends with the output)
                return "", ""
            if head and not any(p.startswith(head) for p in (*self.markers, *self.starts)):
                self._state = "content"
        if self._state != "content":
            return "", None
        hits = [i for i in (self._buf.find(m) for m in self.markers) if i >= 0]
        if hits:
            text, self._buf = self._buf[: min(hits)], self._buf[min(hits) :]
            return text, ""
        keep = 0 if final else max((held_prefix(self._buf, m) for m in self.markers), default=0)
        text, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
        return text, None

    def _after_fail(self) -> None:
        self._state = "content"

    def _between(self, final: bool) -> str:
        while True:
            g = self._gap
            self._consume(len(g) - len(g.lstrip(_BLANKS + ";,")))
            g = self._gap
            if not g:
                if not final:
                    return "wait"
                return "end" if self._brackets == 0 and self._calls else "fail"
            marker = next((m for m in self.markers if g.startswith(m)), None)
            if marker is not None:
                self._consume(len(marker))
                continue
            if not final and any(m.startswith(g) for m in self.markers):
                return "wait"
            if g[0] in "[]":
                self._brackets += 1 if g[0] == "[" else -1
                if self._brackets < 0:
                    return "fail"
                self._consume(1)
                continue
            if g[0] == "{":
                self._start()
                return "call"
            return self._other(g, final)

    def _other(self, gap: str, final: bool) -> str:
        """A block's text that is neither a call object nor a separator."""
        return "fail"


class MistralParser(JsonCallsParser):
    """Mistral's JSON array, and its newer `[TOOL_CALLS]name[ARGS]{...}` form. Its chat
    templates take only 9-character alphanumeric call ids."""

    ID_LENGTH = 9
    ARGS_KEYS = ("arguments", "parameters")
    ARGS_TAG = "[ARGS]"
    _NAME = re.compile(r"[A-Za-z0-9_.\-]+")

    def __init__(self) -> None:
        super().__init__(markers=("[TOOL_CALLS]",), starts=("[",))

    def new_id(self) -> str:
        return super().new_id().removeprefix("call_")

    def _other(self, gap: str, final: bool) -> str:
        m = self._NAME.match(gap)
        if m is None:
            return "fail"
        after = gap[m.end() :]
        if after.startswith(self.ARGS_TAG):
            self._consume(m.end() + len(self.ARGS_TAG))
            self._start(m.group())
            return "call"
        return "wait" if not final and self.ARGS_TAG.startswith(after) else "fail"


class DeepSeekParser(BlockParser):
    """DeepSeek-R1 / V3: `<｜tool▁calls▁begin｜>` then per call
    `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`,
    then `<｜tool▁calls▁end｜>`. V3.1's `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}` is read too.
    The arguments may be written as a JSON string (the templates render them with `tojson`)."""

    CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    SEP = "<｜tool▁sep｜>"
    FENCE, JSON_FENCE = "```", "\n```json\n"
    _NAME = re.compile(r"[\w.\-]+")

    def _find_block(self, final: bool) -> tuple[str, str | None]:
        return self._find_tag(self.CALLS_BEGIN, final)

    def _between(self, final: bool) -> str:
        while True:
            g = self._gap
            self._consume(len(g) - len(g.lstrip(_BLANKS)))
            g = self._gap
            if not g:
                return ("end" if self._calls else "fail") if final else "wait"
            tag = next((t for t in (self.FENCE, self.CALL_END) if g.startswith(t)), None)
            if tag is not None:
                self._consume(len(tag))
                continue
            if g.startswith(self.CALLS_END):
                self._consume(len(self.CALLS_END))
                return "end" if self._calls else "fail"
            if g.startswith(self.CALL_BEGIN):
                return self._head(g[len(self.CALL_BEGIN) :], final)
            tags = (self.FENCE, self.CALL_END, self.CALLS_END, self.CALL_BEGIN)
            return "wait" if not final and any(t.startswith(g) for t in tags) else "fail"

    def _head(self, text: str, final: bool) -> str:
        """A call's head (`text` follows its begin tag): "call" once its arguments begin."""
        i = text.find(self.SEP)
        word = text[:i] if i >= 0 else text[: len(text) - held_prefix(text, self.SEP)]
        if word and not self._NAME.fullmatch(word):
            return "fail"
        if i < 0:
            return "fail" if final else "wait"
        after = text[i + len(self.SEP) :]
        n = len(self.CALL_BEGIN) + i + len(self.SEP)
        if after.lstrip(_BLANKS)[:1] in ("{", '"'):  # V3.1: the name came before the separator
            return self._begin(word, n)
        m = self._NAME.match(after)
        if word == "function" and m is not None and after[m.end() :].startswith(self.JSON_FENCE):
            return self._begin(m.group(), n + m.end() + len(self.JSON_FENCE))
        rest = after[m.end() :] if m is not None else after
        possible = word == "function" and self.JSON_FENCE.startswith(rest)
        return "wait" if not final and (possible or not after.strip(_BLANKS)) else "fail"

    def _begin(self, name: str, n: int) -> str:
        self._consume(n)
        self._start(name)
        return "call"
