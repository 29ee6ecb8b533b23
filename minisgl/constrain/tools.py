"""Grammars that force a tool call: the call objects (`{"name": ..., args_key: {...}}`) of the
allowed functions, each argument object following its function's parameter schema, written
in the model's own call format (between its tags, or as items of one JSON array).

A request carries the calls to force as a `Constraint` of kind "tool_calls" (`ForcedCalls` as
JSON); the grammar is built where grammars compile, on the compile threads, since building it
costs about a millisecond per function."""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

from minisgl.constrain.grammar import JSON_MAX_WHITESPACE, GrammarError
from minisgl.constrain.schema import UnenforceableSchema, check_enforceable

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
                check_enforceable(f.parameters if f.parameters is not None else EMPTY_PARAMETERS)
            except UnenforceableSchema as e:
                raise GrammarError("tools", f"function {f.name!r}: {e}") from None

    def grammar(self) -> str:
        """The EBNF text of the calls (GrammarError as `check`)."""
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
    """EBNF of one call (or, with `parallel`, one or more) of `functions`; GrammarError (kind
    "tools") when a parameter schema cannot be enforced."""
    import xgrammar as xgr

    ForcedCalls(functions, layout, parallel).check()
    if layout.call_head:
        return _named_calls_grammar(functions, layout, parallel)
    schema = call_object_schema(functions, layout.args_key)
    if layout.array:
        schema = {"type": "array", "items": schema, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
    try:
        call = xgr.Grammar.from_json_schema(
            json.dumps(schema), any_whitespace=True, max_whitespace_cnt=JSON_MAX_WHITESPACE
        )
    except (RuntimeError, ValueError) as e:
        raise GrammarError("tools", f"a parameter schema cannot be compiled: {e}") from None
    parts = [_literal(layout.open), call, _literal(layout.close)]
    one = xgr.Grammar.concat(*[p for p in parts if p is not None])
    if layout.array or not parallel:
        return str(one)
    return _repeated(one, layout.separator)


def _named_calls_grammar(
    functions: list[FunctionSchema], layout: CallLayout, parallel: bool
) -> str:
    """Calls whose name is written outside the arguments object (DeepSeek's)."""
    import xgrammar as xgr

    options = []
    for f in functions:
        params = f.parameters if f.parameters is not None else EMPTY_PARAMETERS
        try:
            args = xgr.Grammar.from_json_schema(
                json.dumps(params), any_whitespace=True, max_whitespace_cnt=JSON_MAX_WHITESPACE
            )
        except (RuntimeError, ValueError) as e:
            raise GrammarError("tools", f"function {f.name!r}: {e}") from None
        head = _literal(layout.call_head.replace("{name}", f.name))
        parts = [head, args, _literal(layout.call_tail)]
        options.append(xgr.Grammar.concat(*[p for p in parts if p is not None]))
    one = options[0] if len(options) == 1 else xgr.Grammar.union(*options)
    calls = _repeated(one, layout.separator) if parallel else str(one)
    # The block's tags around the calls: the calls' root becomes a rule of its own.
    text = re.sub(r"^root ::= ", "calls ::= ", calls, count=1, flags=re.MULTILINE)
    return f"root ::= {_quoted(layout.open)} calls {_quoted(layout.close)}\n{text}"


def _repeated(one: Any, separator: str) -> str:
    """One or more of the grammar `one`: its root becomes a rule of its own, repeated."""
    text = re.sub(r"^root ::= ", "one_call ::= ", str(one), count=1, flags=re.MULTILINE)
    return f"root ::= one_call ({_quoted(separator)} one_call)*\n{text}"


def _quoted(text: str) -> str:
    """An EBNF string literal (non-ASCII characters as they are: tags such as DeepSeek's)."""
    return json.dumps(text, ensure_ascii=False)


def _literal(text: str) -> Any:
    import xgrammar as xgr

    return xgr.Grammar.from_ebnf(f"root ::= {_quoted(text)}") if text else None
