from __future__ import annotations

import json
from dataclasses import dataclass

from minisgl.core.errors import InvalidRequestError

CONSTRAINT_KINDS = ("json_schema", "regex", "ebnf", "tool_calls")


@dataclass(frozen=True)
class Constraint:
    """A grammar the output must follow: a JSON schema (JSON text), a regex, an EBNF grammar
    (GBNF, or llguidance's Lark), or forced tool calls (the functions' schemas and the call
    format, as JSON: `minisgl.constrain.tools.ForcedCalls`, made a grammar where grammars
    compile, off the API's loop). Compiled by `minisgl.constrain`; only checked for shape
    here."""

    kind: str  # one of CONSTRAINT_KINDS
    text: str

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidRequestError(f"constraint: unknown kind {self.kind!r}")
        if not isinstance(self.text, str) or not self.text.strip():
            raise InvalidRequestError(f"{self.kind}: must be a non-empty string")
        if self.kind in ("json_schema", "tool_calls"):
            try:
                value = json.loads(self.text)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"{self.kind}: not valid JSON ({e})") from None
            if not isinstance(value, (dict, bool) if self.kind == "json_schema" else dict):
                raise InvalidRequestError(f"{self.kind}: must be a JSON object")


# What OpenAI's `response_format: {"type": "json_object"}` asks for: any JSON object.
JSON_OBJECT = Constraint("json_schema", '{"type": "object"}')
