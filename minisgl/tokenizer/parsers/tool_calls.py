"""Tool-call parsers of the common open-model formats, and how each format's calls are
written (for the grammar that forces a call).

- Hermes (Qwen2.5, Qwen3, NousHermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one tag per call, anywhere in the output.
- Llama 3.x JSON: `{"name": ..., "parameters": {...}}` as the whole output, after an optional
  `<|python_tag|>`; several calls separated by `;`.
- Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`; the marker is a special
  token, so without it (skip_special_tokens) an output that is such an array counts too.
- JSON (no parser known): an output that is one call object or an array of them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from minisgl.config import TOOL_CALL_PARSERS
from minisgl.tokenizer.parsers.base import ParsedCall, ParsedDelta, ToolCallParser, held_prefix

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


FORMATS = {
    "hermes": CallFormat("hermes", open="<tool_call>\n", close="\n</tool_call>", separator="\n"),
    "llama3": CallFormat("llama3", args_key="parameters", separator="; "),
    "mistral": CallFormat("mistral", array=True),
    "json": CallFormat("json", array=True),
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
    raise ValueError(f"unknown tool-call parser {name!r}; one of {', '.join(TOOL_CALL_PARSERS)}")


def detect_tool_call_parser(template: str | None) -> str | None:
    """The parser of the calls a chat template asks its model for, or None when it shows
    none this module knows."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("ipython" in template and "parameters" in template):
        return "llama3"
    return None


def _call_fields(item: Any, args_keys: tuple[str, ...]) -> tuple[str, Any] | None:
    """(name, arguments) of a call object, or None when `item` is not one."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return None
    args: Any = {}
    for key in args_keys:
        if key in item:
            args = item[key]
            break
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return (item["name"], args) if isinstance(args, dict) else None


class HermesParser(ToolCallParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._inside = False  # after an OPEN whose CLOSE has not come yet

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        out = ParsedDelta()
        while True:
            if not self._inside:
                i = self._buf.find(self.OPEN)
                if i < 0:
                    keep = held_prefix(self._buf, self.OPEN)
                    out.content += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                out.content += self._buf[:i]
                self._buf = self._buf[i + len(self.OPEN) :]
                self._inside = True
            else:
                j = self._buf.find(self.CLOSE)
                if j < 0:
                    return out
                body, self._buf = self._buf[:j], self._buf[j + len(self.CLOSE) :]
                self._inside = False
                self._add(out, body, self.OPEN + body + self.CLOSE)

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._inside:  # a call the output ended in (a stop before its closing tag)
            self._add(out, self._buf, self.OPEN + self._buf)
        else:
            out.content = self._buf
        self._buf, self._inside = "", False
        return out

    def _add(self, out: ParsedDelta, body: str, original: str) -> None:
        call = self._parse(body)
        if call is None:
            out.content += original
        else:
            out.calls.append(call)

    def _parse(self, body: str) -> ParsedCall | None:
        try:
            item = json.loads(body)
        except json.JSONDecodeError:
            return None
        fields = _call_fields(item, ("arguments", "parameters"))
        return self.new_call(*fields) if fields is not None else None


class JsonCallsParser(ToolCallParser):
    """Calls that make up the rest of the output: after a marker, or when the output starts
    with one of `starts`. Such an output is held to its end, then parsed as a whole: all of it
    calls, or all of it content."""

    ARGS_KEYS = ("parameters", "arguments")

    def __init__(self, markers: tuple[str, ...], starts: tuple[str, ...]) -> None:
        super().__init__()
        self.markers = markers
        self.starts = starts
        self._buf = ""
        self._state = "undecided"  # | "content" | "calls"

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        if self._state == "undecided":
            self._decide()
        if self._state != "content":
            return ParsedDelta()
        return ParsedDelta(content=self._content())

    def _decide(self) -> None:
        head = self._buf.lstrip()
        if any(head.startswith(p) for p in (*self.markers, *self.starts)):
            self._state = "calls"
        elif head and not any(p.startswith(head) for p in (*self.markers, *self.starts)):
            self._state = "content"

    def _content(self) -> str:
        """The content up to a marker (the rest is held as calls) or up to what may start one."""
        hits = [i for i in (self._buf.find(m) for m in self.markers) if i >= 0]
        if hits:
            i = min(hits)
            text, self._buf, self._state = self._buf[:i], self._buf[i:], "calls"
            return text
        keep = max((held_prefix(self._buf, m) for m in self.markers), default=0)
        text, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
        return text

    def finish(self) -> ParsedDelta:
        text, self._buf = self._buf, ""
        if self._state != "calls":
            return ParsedDelta(content=text)
        items = self._items(self._strip_markers(text))
        fields = [_call_fields(x, self.ARGS_KEYS) for x in items] if items else None
        if not fields or any(f is None for f in fields):
            return ParsedDelta(content=text)
        return ParsedDelta(calls=[self.new_call(*f) for f in fields if f is not None])

    def _strip_markers(self, text: str) -> str:
        for m in self.markers:
            text = text.replace(m, "")
        return text.strip()

    def _items(self, text: str) -> list[Any] | None:
        """The JSON values of `text`, one after another (separated by blanks, `;` or `,`),
        arrays flattened; None unless all of it parses."""
        decoder, items, i = json.JSONDecoder(), [], 0
        while i < len(text):
            try:
                value, i = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                return None
            items += value if isinstance(value, list) else [value]
            while i < len(text) and text[i] in " \t\r\n;,":
                i += 1
        return items


class MistralParser(JsonCallsParser):
    """Mistral's JSON array, and its newer `[TOOL_CALLS]name[ARGS]{...}` form. Its chat
    templates take only 9-character alphanumeric call ids."""

    ID_LENGTH = 9
    ARGS_KEYS = ("arguments", "parameters")
    _NAMED = re.compile(r"\s*([A-Za-z0-9_.\-]+)\[ARGS\]")

    def __init__(self) -> None:
        super().__init__(markers=("[TOOL_CALLS]",), starts=("[",))

    def new_id(self) -> str:
        return super().new_id().removeprefix("call_")

    def _items(self, text: str) -> list[Any] | None:
        if not self._NAMED.match(text):
            return super()._items(text)
        items, decoder, i = [], json.JSONDecoder(), 0
        while i < len(text):
            m = self._NAMED.match(text, i)
            if m is None:
                return None
            try:
                args, i = decoder.raw_decode(text, m.end())
            except json.JSONDecodeError:
                return None
            items.append({"name": m.group(1), "arguments": args})
            i += len(text[i:]) - len(text[i:].lstrip())
        return items
