"""Which JSON schemas the grammar engine enforces in full.

A schema is first checked against the JSON Schema 2020-12 meta-schema (with the `jsonschema`
package), so that a malformed one is refused with the place and the reason rather than
compiled into something else, and so that the checks below see well-formed keywords.
xgrammar compiles some keywords into its grammar and silently ignores others (probed on
xgrammar 0.2: `allOf`, `not`, `if`/`then`/`else`, `uniqueItems`, `contains`, `dependentRequired`,
`dependentSchemas`, `dependencies`, `multipleOf` on numbers, the siblings of a `$ref`, an
`anyOf`/`oneOf`, an `enum` or a `const`, a `pattern` beside `format` or a length,
type-specific keywords in a schema without `type`, `required` names that `properties` does not
list). A schema with any of them would give output that the schema refuses, so
`check_enforceable` refuses the schema instead, naming the place and what to change. `oneOf` is
enforced as `anyOf`, which is the same only when no value can match two branches: its branches
must differ in type or in the `const`/`enum` of a property they all require.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import jsonschema

# Keywords that never change which values match (or that only hold subschemas checked apart).
_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$schema",
        "$id",
        "$defs",
        "definitions",
        "discriminator",  # OpenAPI's hint beside a oneOf; the branches decide
    }
)
_IGNORED = (
    "allOf",
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "$dynamicRef",
    "$recursiveRef",
    "contains",
    "minContains",
    "maxContains",
)
# Keywords that xgrammar reads only when the schema's type says what they apply to (or, for
# objects and arrays, when `properties` / `items` does).
_TYPED = {
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "string": ("minLength", "maxLength", "pattern", "format"),
    "array": ("minItems", "maxItems"),
    "object": ("minProperties", "maxProperties", "required", "propertyNames"),
}
_IMPLIES = {"object": ("properties", "additionalProperties"), "array": ("items", "prefixItems")}
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMAS = (
    "additionalProperties",
    "unevaluatedProperties",
    "items",
    "unevaluatedItems",
    "propertyNames",
)


class UnenforceableSchema(ValueError):
    """The schema uses something the grammar engine would not enforce (the message says
    where and what to change)."""


def check_enforceable(schema: Any) -> None:
    """Raise UnenforceableSchema unless `schema` is a valid JSON Schema (2020-12) whose every
    keyword is enforced."""
    try:
        # Without format checks: `pattern`s are ECMA-262 regexes, which xgrammar checks itself.
        jsonschema.Draft202012Validator.check_schema(schema, format_checker=None)
    except jsonschema.SchemaError as e:
        where = "/" + "/".join(str(p) for p in e.path)
        raise _refuse(where, f"not a valid JSON Schema (2020-12): {e.message}") from None
    _Checker(schema).check(schema, "")


class _Checker:
    def __init__(self, root: Any) -> None:
        self.root = root

    def check(self, s: Any, path: str) -> None:
        if not isinstance(s, dict):
            return  # true / false, or a shape xgrammar itself refuses
        where = path or "/"
        for kw in _IGNORED:
            if kw in s:
                raise _refuse(where, f"`{kw}` is not enforced; remove it")
        if s.get("uniqueItems") is True:
            raise _refuse(where, "`uniqueItems` is not enforced; remove it")
        self._siblings(s, where)
        self._typed(s, where)
        self._strings(s, where)
        self._required(s, where)
        if "oneOf" in s:
            self._one_of(s["oneOf"], where)
        for key, sub in _subschemas(s):
            if key == "propertyNames" and isinstance(sub, dict):
                sub = {"type": "string", **sub}  # names are strings, and xgrammar reads them so
            self.check(sub, f"{path}/{key}")

    def _siblings(self, s: dict[str, Any], where: str) -> None:
        """`$ref`, `anyOf`/`oneOf`, `enum`/`const` win over every other keyword beside them."""
        for kw in ("$ref", "anyOf", "oneOf", "enum", "const"):
            if kw not in s:
                continue
            allowed = {kw} | ({"type"} if kw in ("enum", "const") else set())
            others = sorted(set(s) - _ANNOTATIONS - allowed)
            if others:
                raise _refuse(
                    where,
                    f"{_names(others)} beside `{kw}` would be ignored; move them into "
                    + ("the referenced schema" if kw == "$ref" else f"each `{kw}` choice"),
                )
        ref = s.get("$ref")
        if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref[:2] == "#/")):
            raise _refuse(where, f"`$ref` {ref!r}: only references into this schema (#/...)")
        if "enum" in s or "const" in s:
            self._values_fit_type(s, where)

    def _values_fit_type(self, s: dict[str, Any], where: str) -> None:
        if "type" not in s:
            return
        types = _type_set(s["type"])
        values = s.get("enum", []) if "enum" in s else [s["const"]]
        for v in values if isinstance(values, list) else []:
            if not _value_types(v) & types:
                raise _refuse(where, f"the value {json.dumps(v)} is not of type {s['type']}")

    def _typed(self, s: dict[str, Any], where: str) -> None:
        for kind, keywords in _TYPED.items():
            given = [k for k in keywords if k in s]
            if not given or "type" in s or any(k in s for k in _IMPLIES.get(kind, ())):
                continue
            raise _refuse(where, f'{_names(given)} needs "type": "{kind}" beside it to be enforced')
        if "multipleOf" in s:
            m = s["multipleOf"]
            if s.get("type") != "integer" or not isinstance(m, int) or isinstance(m, bool):
                raise _refuse(
                    where, '`multipleOf` is enforced only as a whole number with "type": "integer"'
                )

    def _strings(self, s: dict[str, Any], where: str) -> None:
        lengths = [k for k in ("minLength", "maxLength") if k in s]
        for kw in ("pattern", "format"):
            if kw in s and lengths:
                raise _refuse(where, f"`{kw}` and {_names(lengths)} are not enforced together")
        if "pattern" in s and "format" in s:
            raise _refuse(where, "`pattern` and `format` are not enforced together")

    def _required(self, s: dict[str, Any], where: str) -> None:
        required, props = s.get("required"), s.get("properties", {})
        if not isinstance(required, list) or not isinstance(props, dict):
            return
        missing = [r for r in required if r not in props]
        if missing:
            raise _refuse(
                where,
                f"`required` names {_names(missing)}, which `properties` does not define; "
                "define them",
            )

    def _one_of(self, branches: Any, where: str) -> None:
        if not isinstance(branches, list):
            return
        resolved = [self._resolve(b) for b in branches]
        for i in range(len(resolved)):
            for j in range(i + 1, len(resolved)):
                if not _disjoint(resolved[i], resolved[j]):
                    raise _refuse(
                        where,
                        f"`oneOf` choices {i} and {j} may both match, and `oneOf` is enforced "
                        "as `anyOf`: use `anyOf`, or make the choices differ in type or in the "
                        "`const` of a property they all require",
                    )

    def _resolve(self, s: Any) -> Any:
        """`s`, or what its local `$ref` points to (followed up to a few times)."""
        for _ in range(8):
            if not (isinstance(s, dict) and isinstance(s.get("$ref"), str)):
                return s
            node = self.root
            for part in s["$ref"].lstrip("#").split("/")[1:]:
                part = part.replace("~1", "/").replace("~0", "~")
                if not isinstance(node, dict) or part not in node:
                    return None  # xgrammar refuses a dangling reference itself
                node = node[part]
            s = node
        return None


def _subschemas(s: dict[str, Any]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key in _SCHEMA_MAPS:
        if isinstance(s.get(key), dict):
            out += [(f"{key}/{name}", sub) for name, sub in s[key].items()]
    for key in _SCHEMA_LISTS:
        if isinstance(s.get(key), list):
            out += [(f"{key}/{i}", sub) for i, sub in enumerate(s[key])]
    out += [(key, s[key]) for key in _SCHEMAS if key in s]
    return out


def _type_set(t: Any) -> set[str]:
    types = set(t) if isinstance(t, list) else {t}
    return types | {"number"} if "integer" in types else types


def _value_types(v: Any) -> set[str]:
    """The JSON types a value has (a whole number is an integer and a number)."""
    if v is None:
        return {"null"}
    if isinstance(v, bool):
        return {"boolean"}
    if isinstance(v, (int, float)):
        whole = isinstance(v, int) or float(v).is_integer()
        return {"integer", "number"} if whole else {"number"}
    if isinstance(v, str):
        return {"string"}
    return {"array"} if isinstance(v, list) else {"object"}


def _types_of(s: Any) -> set[str] | None:
    """The JSON types a schema can match, when it says (by `type`, `const` or `enum`)."""
    if not isinstance(s, dict):
        return None
    if "type" in s:
        return _type_set(s["type"])
    if "const" in s:
        return _value_types(s["const"])
    if isinstance(s.get("enum"), list):
        return set().union(*(_value_types(v) for v in s["enum"]))
    return None


def _disjoint(a: Any, b: Any) -> bool:
    """True when no value can match both schemas (judged by type or by a discriminator)."""
    ta, tb = _types_of(a), _types_of(b)
    if ta is not None and tb is not None and not ta & tb:
        return True
    return ta == tb == {"object"} and _discriminated(a, b)


def _discriminated(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Both objects require a property whose allowed values (const / enum) do not overlap."""
    common = set(a.get("required", ())) & set(b.get("required", ()))
    for name in common:
        va = _allowed_values(a.get("properties", {}).get(name))
        vb = _allowed_values(b.get("properties", {}).get(name))
        if va is not None and vb is not None and not va & vb:
            return True
    return False


def _allowed_values(s: Any) -> set[str] | None:
    if not isinstance(s, dict):
        return None
    if "const" in s:
        return {json.dumps(s["const"], sort_keys=True)}
    if isinstance(s.get("enum"), list):
        return {json.dumps(v, sort_keys=True) for v in s["enum"]}
    return None


def _names(keys: Sequence[str]) -> str:
    return ", ".join(f"`{k}`" for k in keys)


def _refuse(where: str, why: str) -> UnenforceableSchema:
    return UnenforceableSchema(f"at {where}: {why}")
