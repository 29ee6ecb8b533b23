from __future__ import annotations

import json
from dataclasses import dataclass

from minisgl.core.errors import InvalidRequestError

CONSTRAINT_KINDS = ("json_schema", "regex", "ebnf")


@dataclass(frozen=True)
class Constraint:
    """A grammar the output must follow: a JSON schema (JSON text), a regex or an EBNF grammar
    (xgrammar's GBNF dialect). Compiled by `minisgl.constrain`; only checked for shape here."""

    kind: str  # one of CONSTRAINT_KINDS
    text: str

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidRequestError(f"constraint: unknown kind {self.kind!r}")
        if not isinstance(self.text, str) or not self.text.strip():
            raise InvalidRequestError(f"{self.kind}: must be a non-empty string")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.text)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"json_schema: not valid JSON ({e})") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError("json_schema: must be a JSON object")


# What OpenAI's `response_format: {"type": "json_object"}` asks for: any JSON object.
JSON_OBJECT = Constraint("json_schema", '{"type": "object"}')
