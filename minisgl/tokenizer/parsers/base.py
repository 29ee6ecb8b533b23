"""The contract of a tool-call parser, what it returns, and the pieces every format shares: a
call read as it is written (`CallText`) and the bookkeeping that streams its arguments."""

from __future__ import annotations

import json
import re
import secrets
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import cache
from typing import Any, NamedTuple

from minisgl.tokenizer.parsers.json_scan import JsonScanner


@dataclass(frozen=True)
class ParsedCall:
    """One complete function call the model wrote; `arguments` is JSON text."""

    index: int  # its place among the choice's calls
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class CallFragment:
    """A piece of a call as it is written. The first piece of each call carries its id and
    name (and no arguments); the arguments pieces that follow, joined, are the call's
    `arguments`."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class ParsedDelta:
    """What one piece of output adds: plain content, the pieces of calls being written, and the
    calls completed by it."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)
    fragments: list[CallFragment] = field(default_factory=list)

    def __iadd__(self, other: ParsedDelta) -> ParsedDelta:
        self.content += other.content
        self.calls += other.calls
        self.fragments += other.fragments
        return self


def call_fields(item: Any, args_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call object, or None when `item` is not one."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return None
    args = _arguments_text(next((item[k] for k in args_keys if k in item), {}))
    return (item["name"], args) if args is not None else None


def _arguments_text(args: Any) -> str | None:
    """The JSON text of an arguments object, which some models write as a JSON string."""
    if isinstance(args, str):
        try:
            return args if isinstance(json.loads(args), dict) else None
        except json.JSONDecodeError:
            return None
    return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None


@cache
def _head_pattern(args_keys: tuple[str, ...]) -> re.Pattern[str]:
    """A call object's text up to its arguments object, when the name comes first."""
    keys = "|".join(re.escape(k) for k in args_keys)
    return re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)+)"\s*,\s*"(?:' + keys + r')"\s*:\s*')


class CallText:
    """One call as it is written: a call object (`{"name": ..., key: {...}}`) or, with `name`
    known from the text around it, its bare arguments object. The arguments stream (as the
    text written) once the name is known and the arguments object has begun; until then the
    call is only held."""

    def __init__(self, args_keys: tuple[str, ...], name: str | None = None) -> None:
        self.args_keys = args_keys
        self.name = name
        self.bare = name is not None
        self.text = ""
        self.args_start: int | None = None  # where the arguments object begins in `text`
        self.args_end: int | None = None
        self.broken = False
        self.index: int | None = None  # set when its first fragment is given out
        self.id = ""
        self.sent = 0  # characters of the arguments given out
        self.committed = False  # given out by an earlier `feed`: it cannot be taken back
        self._scanner = JsonScanner()
        self._args_depth = 1 if self.bare else 2

    @property
    def done(self) -> bool:
        return self._scanner.done

    @property
    def arguments(self) -> str:
        assert self.args_start is not None
        return self.text[self.args_start : self.args_end]

    def feed(self, text: str) -> int:
        """Reads `text` up to the call's end or first invalid character; returns how many of its
        characters belong to the call."""
        for i, ch in enumerate(text):
            if self.done:
                return i
            if not self._scanner.step(ch):
                self.broken = True
                return i
            self.text += ch
            self._track(ch)
        return len(text)

    def _track(self, ch: str) -> None:
        depth = self._scanner.depth
        if self.args_start is None:
            if ch == "{" and depth == self._args_depth and self._name_known():
                self.args_start = len(self.text) - 1
        elif self.args_end is None and depth < self._args_depth:
            self.args_end = len(self.text)

    def _name_known(self) -> bool:
        if self.bare:
            return True
        m = _head_pattern(self.args_keys).fullmatch(self.text[:-1])
        if m is None:
            return False
        self.name = json.loads(f'"{m.group(1)}"')
        return True

    def whole(self) -> tuple[str, str] | None:
        """(name, arguments text) of the finished call, or None when it is no call."""
        if self.args_start is not None and self.args_end is not None and self.name is not None:
            return self.name, self.arguments
        try:
            value = json.loads(self.text)
        except json.JSONDecodeError:
            return None
        if self.bare:
            args = _arguments_text(value)
            return (self.name, args) if self.name is not None and args is not None else None
        return call_fields(value, self.args_keys)


class Mark(NamedTuple):
    """Where a delta stood before a call's pieces went into it (to take them back)."""

    fragments: int
    calls: int
    num_calls: int


class ToolCallParser(ABC):
    """Splits one choice's output into content and tool calls, fed piece by piece (a stream) or
    all at once. Text that looks like a call but does not parse as one is given back as
    content: a model's malformed call never becomes an error.

    `feed` holds text back only while it cannot tell yet (a tag's first characters, a call
    whose name is not written yet). Once a call's name and the start of its arguments are
    written, its first fragment (id, name) goes out and its arguments follow as written; such a
    call cannot be taken back, so if the output then breaks off (a length limit) it stays a
    call with the arguments written so far. A whole output (`parse`) is all known at once:
    there a malformed call is always content."""

    ID_ALPHABET = string.ascii_letters + string.digits
    ID_LENGTH = 24

    def __init__(self) -> None:
        self.num_calls = 0
        self._fresh: list[CallText] = []  # calls whose first fragment this feed gave out
        self._mark: Mark | None = None

    @abstractmethod
    def _read(self, text: str, final: bool) -> ParsedDelta:
        """`text` added to the output; `final`: nothing follows it."""

    def feed(self, text: str) -> ParsedDelta:
        out = self._read(text, final=False)
        for call in self._fresh:
            call.committed = True
        self._fresh, self._mark = [], None
        return out

    def finish(self) -> ParsedDelta:
        """Whatever is held at the end of the output."""
        return self._read("", final=True)

    def parse(self, text: str) -> ParsedDelta:
        """A whole output at once."""
        return self._read(text, final=True)

    def stream(self, out: ParsedDelta, call: CallText) -> None:
        """Adds to `out` what `call` gained: its head once its name is known, then the new part
        of its arguments."""
        if call.args_start is None:
            return
        if call.index is None:
            self._note(out)
            call.index, call.id = self.num_calls, self.new_id()
            self.num_calls += 1
            self._fresh.append(call)
            out.fragments.append(CallFragment(call.index, "", call.id, call.name))
        new = call.arguments[call.sent :]
        if new:
            out.fragments.append(CallFragment(call.index, new))
            call.sent += len(new)

    def end_call(self, out: ParsedDelta, call: CallText) -> bool:
        """Adds the ended `call` to `out` (with what it wrote, when it streamed and broke off);
        False when it is no call."""
        if call.index is not None:
            assert call.name is not None
            out.calls.append(ParsedCall(call.index, call.id, call.name, call.arguments))
            return True
        fields = call.whole() if call.done else None
        if fields is None:
            return False
        self._note(out)
        c = self.new_call(*fields)
        out.fragments += [
            CallFragment(c.index, "", c.id, c.name),
            CallFragment(c.index, c.arguments),
        ]
        out.calls.append(c)
        return True

    def _note(self, out: ParsedDelta) -> None:
        if self._mark is None:
            self._mark = Mark(len(out.fragments), len(out.calls), self.num_calls)

    def take_back(self, out: ParsedDelta, text: str) -> None:
        """Removes from `out` the calls added since the mark and gives `text` as content."""
        if self._mark is not None:
            del out.fragments[self._mark.fragments :]
            del out.calls[self._mark.calls :]
            self.num_calls = self._mark.num_calls
            self._mark = None
        out.content += text

    def new_call(self, name: str, arguments: str) -> ParsedCall:
        """The next call of this choice, with a fresh id."""
        call = ParsedCall(self.num_calls, self.new_id(), name, arguments)
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
