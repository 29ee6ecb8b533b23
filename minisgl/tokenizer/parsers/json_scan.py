"""JSON read one character at a time as a model writes it: whether the text so far can still
become valid JSON, how deep in containers it is, and where one value ends."""

from __future__ import annotations

import re

_WS = " \t\r\n"
_HEX = "0123456789abcdefABCDEF"
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")


class JsonScanner:
    """A validator of one JSON value, fed a character at a time. `step` is False for the first
    character that no valid JSON value can continue with; `done` once the value is whole.

    A number is only known to end at the character after it, so a bare top-level number never
    reads as done (callers scan objects)."""

    def __init__(self) -> None:
        self.stack: list[str] = []  # the open containers, "{" or "["
        # value | value_or_end | key | key_or_end | colon | comma_or_end
        # | string | escape | unicode | literal | number | end
        self.state = "value"
        self._is_key = False
        self._hex_left = 0
        self._word = ""  # the literal or number being read

    @property
    def depth(self) -> int:
        return len(self.stack)

    @property
    def done(self) -> bool:
        return self.state == "end"

    def step(self, ch: str) -> bool:
        s = self.state
        if s == "end":
            return False
        if s in ("string", "escape", "unicode"):
            return self._string(ch)
        if s == "literal":
            self._word += ch
            target = _LITERALS[self._word[0]]
            if not target.startswith(self._word):
                return False
            if self._word == target:
                self._value_end()
            return True
        if s == "number":
            if ch in "0123456789+-.eE":
                self._word += ch
                return True
            if not _NUMBER.fullmatch(self._word):
                return False
            self._value_end()
            return self.step(ch)
        if ch in _WS:
            return True
        return self._structure(s, ch)

    def _structure(self, s: str, ch: str) -> bool:
        if s in ("value", "value_or_end"):
            if ch == "]" and s == "value_or_end":
                return self._close("[")
            return self._value_start(ch)
        if s in ("key", "key_or_end"):
            if ch == "}" and s == "key_or_end":
                return self._close("{")
            self.state, self._is_key = "string", True
            return ch == '"'
        if s == "colon":
            self.state = "value"
            return ch == ":"
        if s == "comma_or_end":
            if ch == ",":
                self.state = "key" if self.stack[-1] == "{" else "value"
                return True
            if ch in "}]":
                return self._close("{" if ch == "}" else "[")
        return False

    def _string(self, ch: str) -> bool:
        if self.state == "escape":
            if ch == "u":
                self.state, self._hex_left = "unicode", 4
            else:
                self.state = "string"
            return ch in '"\\/bfnrtu'
        if self.state == "unicode":
            self._hex_left -= 1
            if self._hex_left == 0:
                self.state = "string"
            return ch in _HEX
        if ch == '"':
            if self._is_key:
                self.state, self._is_key = "colon", False
            else:
                self._value_end()
        elif ch == "\\":
            self.state = "escape"
        return ch >= " "

    def _value_start(self, ch: str) -> bool:
        if ch in "{[":
            self.stack.append(ch)
            self.state = "key_or_end" if ch == "{" else "value_or_end"
        elif ch == '"':
            self.state, self._is_key = "string", False
        elif ch in _LITERALS:
            self.state, self._word = "literal", ch
        elif ch in "-0123456789":
            self.state, self._word = "number", ch
        else:
            return False
        return True

    def _close(self, kind: str) -> bool:
        if not self.stack or self.stack[-1] != kind:
            return False
        self.stack.pop()
        self._value_end()
        return True

    def _value_end(self) -> None:
        self.state = "comma_or_end" if self.stack else "end"
