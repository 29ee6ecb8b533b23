"""Grammars that force a tool call: the call objects (`{"name": ..., args_key: {...}}`) of the
allowed functions, each argument object following its function's parameter schema, written
in the model's own call format (between its tags, or as items of one JSON array).

A request carries the calls to force as a `Constraint` of kind "tool_calls" (`ForcedCalls` as
JSON); the grammar is built where grammars compile, on the compile threads, since building it
costs about a millisecond per function."""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from minisgl.constrain.base import GrammarError
from minisgl.constrain.schema import UnenforceableSchema, for_llguidance, json_grammar

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class FunctionSchema(NamedTuple):
    name: str
    parameters: dict[str, Any] | None  # a JSON schema of the arguments; None: no arguments


class CallLayout(NamedTuple):
    """How calls are written (see `minisgl.tokenizer.parsers.CallFormat`). With `call_head`,
    a call is its head (`{name}` replaced by the function's name), the bare arguments object
    and `call_tail`, and `open` / `close` wrap the whole block of calls."""

    args_key: str
    open: str
    close: str
    separator: str
    array: bool
    call_head: str = ""
    call_tail: str = ""


class ForcedCalls(NamedTuple):
    """The calls a request forces: one of `functions` (or, with `parallel`, one or more), in
    `layout`."""

    functions: list[FunctionSchema]
    layout: CallLayout
    parallel: bool

    def to_text(self) -> str:
        functions = [list(f) for f in self.functions]
        return json.dumps(
            {"functions": functions, "layout": list(self.layout), "parallel": self.parallel}
        )

    @classmethod
    def from_text(cls, text: str) -> ForcedCalls:
        d = json.loads(text)
        functions = [FunctionSchema(*f) for f in d["functions"]]
        return cls(functions, CallLayout(*d["layout"]), d["parallel"])

    def check(self) -> None:
        """GrammarError (kind "tools") when a parameter schema cannot be enforced: a quick check
        before the grammar is built."""
        for f in self.functions:
            try:
                json_grammar(f.parameters if f.parameters is not None else EMPTY_PARAMETERS)
            except UnenforceableSchema as e:
                raise GrammarError("tools", f"function {f.name!r}: {e}") from None

    def lark(self) -> str:
        """The grammar of the calls, in llguidance's Lark (GrammarError as `check`)."""
        return forced_calls_grammar(self.functions, self.layout, self.parallel)


def call_object_schema(functions: list[FunctionSchema], args_key: str) -> dict[str, Any]:
    """The JSON schema of one call of any of `functions`."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f.name},
                args_key: f.parameters if f.parameters is not None else EMPTY_PARAMETERS,
            },
            "required": ["name", args_key],
            "additionalProperties": False,
        }
        for f in functions
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def forced_calls_grammar(
    functions: list[FunctionSchema], layout: CallLayout, parallel: bool
) -> str:
    """The Lark grammar (llguidance's, JSON schemas inline) of one call (or, with `parallel`,
    one or more) of `functions`; GrammarError (kind "tools") when a parameter schema cannot be
    enforced."""
    ForcedCalls(functions, layout, parallel).check()
    if layout.call_head:
        options = [
            _seq(
                _quoted(layout.call_head.replace("{name}", f.name)),
                _json(f.parameters if f.parameters is not None else EMPTY_PARAMETERS),
                _quoted(layout.call_tail),
            )
            for f in functions
        ]
        one = "(" + " | ".join(options) + ")"
        calls = f"{one} ({_quoted(layout.separator)} {one})*" if parallel else one
        return f"start: {_seq(_quoted(layout.open), calls, _quoted(layout.close))}\n"
    schema = call_object_schema(functions, layout.args_key)
    if layout.array:
        schema = {"type": "array", "items": schema, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
    one = _seq(_quoted(layout.open), _json(schema), _quoted(layout.close))
    if not layout.array and parallel:
        return f"start: one ({_quoted(layout.separator)} one)*\none: {one}\n"
    return f"start: {one}\n"


def _json(schema: dict[str, Any]) -> str:
    """An inline JSON schema of a Lark grammar (GrammarError when it cannot be enforced)."""
    try:
        return "%json " + json.dumps(for_llguidance(schema))
    except UnenforceableSchema as e:
        raise GrammarError("tools", f"a parameter schema cannot be enforced: {e}") from None


def _seq(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _quoted(text: str) -> str:
    """A Lark string literal ("" for no text)."""
    return json.dumps(text, ensure_ascii=False) if text else ""
