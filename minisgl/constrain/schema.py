"""JSON schemas made ready for the grammar engine (llguidance), or refused with a reason.

A schema is first checked against its draft's meta-schema (2020-12 unless `$schema` names an
earlier one; with the `jsonschema` package), so that a malformed one is refused with the place
and the reason rather than compiled into something else. llguidance itself refuses the keywords
it does not implement (`not`, `if`/`then`/`else`, `uniqueItems`, `contains`,
`unevaluatedProperties`, ...) and schemas it finds unsatisfiable, so `prepare` refuses only
what it would let through half-enforced, and writes down this project's own semantics:

- a schema of an earlier draft (`$schema` of draft 4 to 2019-09) is checked against its own
  meta-schema and written in 2020-12's words: a list of `items` (with `additionalItems`) as
  `prefixItems` (and `items`), draft 4's boolean `exclusiveMinimum`/`exclusiveMaximum` as
  numbers; draft 3 is refused;
- `additionalItems` beside `prefixItems` would be silently ignored: refused; elsewhere (no list
  of `items`) it constrains nothing in any draft and is dropped, as is `uniqueItems: false`;
- `not: {}` (or `not: true`) matches nothing: the schema is written `false`;
- `dependencies`, `dependentRequired` and `dependentSchemas` are written as `allOf`/`anyOf`
  (each property named absent, or present with what it needs), and a `oneOf` of choices that
  each require one name alone as the choice of one name present and the others absent;
- an object schema with `properties` or `patternProperties` and no `additionalProperties` takes
  no other properties (`additionalProperties: false` is written in), so `required` names must
  be among its `properties`;
- `oneOf` is enforced as `anyOf`, which is the same only when no value can match two choices:
  its choices must differ in type, in the `const`/`enum` of a property they all require, or
  in a property one requires and the other (an object taking no other properties) has not;
- `propertyNames` is enforced as `patternProperties` (a `pattern`) or as named properties (an
  `enum` or `const`);
- a `format` llguidance does not know is an annotation, as JSON Schema 2020-12 has every format
  by default: it is dropped. Annotations (`title`, `description`, `examples`, `default`,
  `readOnly`, `writeOnly`, `deprecated`, `$comment`) never cause a refusal.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import jsonschema

from minisgl.constrain.base import JSON_MAX_WHITESPACE

# Formats llguidance enforces (any other is dropped as an annotation).
KNOWN_FORMATS = frozenset(
    {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"}
)
LATEST = jsonschema.Draft202012Validator
_DRAFTS = {jsonschema.Draft4Validator: "draft 4", jsonschema.Draft6Validator: "draft 6",
           jsonschema.Draft7Validator: "draft 7", jsonschema.Draft201909Validator: "2019-09"}  # fmt: skip
# Keywords whose values are schemas (maps of them, lists of them, or one).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = (
    *("items", "additionalProperties", "not", "if", "then", "else", "contains"),
    *("propertyNames", "unevaluatedProperties", "unevaluatedItems"),
)


# llguidance's JSON options: the whitespace JSON output may hold between tokens; `coerce_one_of`:
# every `oneOf` left by `prepare` has choices no value can match twice.
JSON_OPTIONS = {
    "whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{JSON_MAX_WHITESPACE}}}",
    "coerce_one_of": True,
}


_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \["([^"]+)"')


class UnenforceableSchema(ValueError):
    """A schema the grammar engine cannot enforce in full; the message says where and why."""


def prepare(schema: Any) -> Any:
    """`schema` as llguidance is to compile it (a copy), or UnenforceableSchema."""
    named = isinstance(schema, dict) and isinstance(schema.get("$schema"), str)
    draft = jsonschema.validators.validator_for(schema, default=LATEST) if named else LATEST
    if draft is jsonschema.Draft3Validator:
        raise _refuse("/$schema", "draft 3 is not supported; write JSON Schema 2020-12")
    try:
        # Without format checks: formats are enforced (or dropped) by the grammar.
        draft.check_schema(schema, format_checker=None)
    except jsonschema.SchemaError as e:
        where, name = "/" + "/".join(str(p) for p in e.path), _DRAFTS.get(draft, "2020-12")
        raise _refuse(where, f"not a valid JSON Schema ({name}): {e.message}") from None
    out = _Preparer(schema, draft).prepare(schema, "")
    if out is False:
        raise _refuse("/", "the schema matches nothing")
    return out


def for_llguidance(schema: Any) -> dict[str, Any]:
    """`schema` prepared, with the JSON options written in (its own `x-guidance` dropped): for
    a grammar of its own or for `%json` in a Lark grammar; UnenforceableSchema."""
    out = prepare(schema)
    out = {} if out is True else {k: v for k, v in out.items() if k != "x-guidance"}
    return {**out, "x-guidance": JSON_OPTIONS}


def json_grammar(schema: Any) -> str:
    """llguidance's grammar of `schema` (prepared), checked as far as can be done without a
    vocabulary; UnenforceableSchema, saying where for a keyword llguidance does not enforce."""
    from llguidance import LLMatcher

    grammar = LLMatcher.grammar_from_json_schema(for_llguidance(schema))
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if not failed:
        return grammar
    message = short_reason(messages[0])
    found = _UNIMPLEMENTED.search(message)
    if found is None:
        raise UnenforceableSchema(message)
    key = found.group(1)
    raise _refuse(locate(schema, key), f"`{key}` is not enforced; remove it")


class _Preparer:
    def __init__(self, root: Any, draft: Any = LATEST) -> None:
        self.root = root
        self.draft = draft

    def prepare(self, s: Any, path: str) -> Any:
        if not isinstance(s, dict):
            return s
        where = path or "/"
        if s.get("not") in ({}, True):
            return False
        s = _one_name_of(_dependencies(_in_2020_12(s, self.draft)))
        if "additionalItems" in s:
            raise _refuse(where, "`additionalItems` is not a 2020-12 keyword and is not enforced "
                          "beside `prefixItems`; use `items` (or a draft-7 `$schema`)")  # fmt: skip
        if "oneOf" in s:
            self._one_of(s["oneOf"], where, _types_of(s))
        out = dict(s)
        if s.get("format") is not None and s["format"] not in KNOWN_FORMATS:
            del out["format"]
        if "propertyNames" in s:
            _property_names(out, where)
        ref = s.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            raise _refuse(where, f"`$ref` {ref!r}: only references into this schema (#...)")
        if _closed_by_default(out):
            out["additionalProperties"] = False
        if out.get("additionalProperties") is False:
            _required(out, where)
        for key in _SCHEMA_MAPS:
            if isinstance(out.get(key), dict):
                out[key] = {k: self.prepare(v, f"{path}/{key}/{k}") for k, v in out[key].items()}
        for key in _SCHEMA_LISTS:
            if isinstance(out.get(key), list):
                out[key] = [self.prepare(v, f"{path}/{key}/{i}") for i, v in enumerate(out[key])]
        for key in _SCHEMAS:
            if key in out:
                out[key] = self.prepare(out[key], f"{path}/{key}")
        return out

    def _one_of(self, branches: Any, where: str, types: set[str] | None) -> None:
        resolved = [self._resolve(b) for b in branches]
        for i in range(len(resolved)):
            for j in range(i + 1, len(resolved)):
                if not _disjoint(resolved[i], resolved[j], types):
                    raise _refuse(
                        where,
                        f"`oneOf` choices {i} and {j} may both match, and `oneOf` is enforced "
                        "as `anyOf`: use `anyOf`, or make the choices differ in type, in the "
                        "`const` of a property they all require, or in a property one requires "
                        "and the other (closed) lacks",
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
                    return None  # the compiler refuses a dangling reference itself
                node = node[part]
            s = node
        return None


def _in_2020_12(s: dict[str, Any], draft: Any) -> dict[str, Any]:
    """`s` (a copy where it changes) in the words of 2020-12: an earlier draft's list of
    `items` and draft 4's boolean exclusive bounds; an `additionalItems` that constrains
    nothing, and `uniqueItems: false`, dropped."""
    s = dict(s)
    if draft is not LATEST:  # (llguidance would read the rest by the draft named)
        s.pop("$schema", None)
    if draft is not LATEST and isinstance(s.get("items"), list):
        s["prefixItems"] = s.pop("items")
        if "additionalItems" in s:
            s["items"] = s.pop("additionalItems")
    if "prefixItems" not in s or "items" in s:
        s.pop("additionalItems", None)  # without a list of items, ignored by every draft
    if s.get("uniqueItems") is False:
        del s["uniqueItems"]
    if draft is jsonschema.Draft4Validator:
        for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
            if s.pop(exclusive, False) is True and bound in s:
                s[exclusive] = s.pop(bound)
    return s


def _dependencies(s: dict[str, Any]) -> dict[str, Any]:
    """`s` with `dependencies`, `dependentRequired` and `dependentSchemas` written as what
    llguidance enforces: for each property named, `allOf` the choice of its absence or of its
    presence with the names it needs (or the schema it brings, which describes the object
    around it and so does not close it)."""
    keys = [k for k in ("dependencies", "dependentRequired", "dependentSchemas") if k in s]
    if not keys:
        return s
    s, extra = dict(s), []
    for name, need in (item for k in keys for item in s.pop(k).items()):
        absent = {"properties": {name: False}, "additionalProperties": True}
        if isinstance(need, list):
            extra.append({"anyOf": [absent, {"required": [name, *need]}]})
        elif need is not True:
            extra.append({"anyOf": [absent, {"required": [name], "allOf": [_opened(need)]}]})
    s["allOf"] = [*s.get("allOf", []), *extra]
    return s


def _one_name_of(s: dict[str, Any]) -> dict[str, Any]:
    """`s` with a `oneOf` whose choices each require one name alone (exactly one of these
    properties) written as what llguidance enforces: `allOf` the choice of one name present and
    the others absent."""
    choices = s.get("oneOf")
    if not (isinstance(choices, list) and choices and all(_one_name(c) for c in choices)):
        return s
    names = [c["required"][0] for c in choices]
    if len(set(names)) < len(names):
        return s
    one = [{"required": [n], "properties": {m: False for m in names if m != n},
            "additionalProperties": True} for n in names]  # fmt: skip
    rest = {k: v for k, v in s.items() if k != "oneOf"}
    return {**rest, "allOf": [*s.get("allOf", []), {"anyOf": one}]}


def _one_name(s: Any) -> bool:
    """A schema that requires one property and says nothing else (annotations aside)."""
    notes = {"required", "title", "description", "$comment"}
    return isinstance(s, dict) and set(s) <= notes and len(s.get("required", ())) == 1


def _opened(s: Any) -> Any:
    """A schema of the object around it, and its `anyOf`/`oneOf`/`allOf` choices, open to
    other properties where they say nothing of them."""
    if not isinstance(s, dict):
        return s
    s = {
        k: [_opened(c) for c in v] if k in ("anyOf", "oneOf", "allOf") else v for k, v in s.items()
    }
    return {**s, "additionalProperties": True} if _closed_by_default(s) else s


def _closed_by_default(s: dict[str, Any]) -> bool:
    """An object schema naming its properties, silent on the others."""
    named = "properties" in s or "patternProperties" in s
    return named and "additionalProperties" not in s and "unevaluatedProperties" not in s


def _required(s: dict[str, Any], where: str) -> None:
    required, props = s.get("required", []), s.get("properties", {})
    patterns = list(s.get("patternProperties", {}))
    missing = [r for r in required if r not in props and not any(_search(p, r) for p in patterns)]
    if missing:
        raise _refuse(
            where,
            f"`required` names {_names(missing)}, which `properties` does not define; define "
            "them (an object without `additionalProperties` takes no other properties)",
        )


def _search(pattern: str, name: str) -> bool:
    """Whether an ECMA-262 `pattern` matches somewhere in `name` (as far as Python's `re` reads
    it; one it cannot read matches nothing)."""
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return False


def _property_names(s: dict[str, Any], where: str) -> None:
    """Rewrite `propertyNames` in `s` (a copy) into what llguidance enforces."""
    names = s.pop("propertyNames")
    if names is True or names == {}:
        return
    if not isinstance(names, dict):
        raise _refuse(where, "`propertyNames: false` allows only `{}`; write `maxProperties: 0`")
    names = {k: v for k, v in names.items() if k not in ("type", "title", "description")}
    rest = s.get("additionalProperties", True)
    if set(names) == {"pattern"} and "patternProperties" not in s:
        fixed = [p for p in s.get("properties", {}) if not _search(names["pattern"], p)]
        if fixed:
            raise _refuse(where, f"{_names(fixed)} do not match `propertyNames`")
        s["patternProperties"] = {names["pattern"]: rest}
    elif set(names) in ({"enum"}, {"const"}) and "patternProperties" not in s:
        allowed = names["enum"] if "enum" in names else [names["const"]]
        props = s.setdefault("properties", {})
        extra = [p for p in props if p not in allowed]
        if extra:
            raise _refuse(where, f"{_names(extra)} are not among the `propertyNames`")
        s["properties"] = {**{n: rest for n in allowed if isinstance(n, str)}, **props}
    else:
        raise _refuse(where, "`propertyNames` is enforced only as one `pattern`, `enum` or `const`")
    s["additionalProperties"] = False


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


def _disjoint(a: Any, b: Any, within: set[str] | None = None) -> bool:
    """True when no value (of the types `within`, when given) can match both schemas: judged
    by type, by a discriminator, or by a property one requires and the other cannot have."""
    ta, tb = _types_of(a), _types_of(b)
    if within is not None:
        ta, tb = (within if t is None else t & within for t in (ta, tb))
    if ta is not None and tb is not None and not ta & tb:
        return True
    objects = ta == tb == {"object"} and isinstance(a, dict) and isinstance(b, dict)
    return objects and (_discriminated(a, b) or _excludes(a, b) or _excludes(b, a))


def _excludes(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """`a` requires a property that `b` cannot have (`b` names its properties and takes no
    other, or says `false` for it)."""
    props = b.get("properties", {})
    closed = _closed_by_default(b) or b.get("additionalProperties") is False
    patterns = list(b.get("patternProperties", {}))
    for name in a.get("required", ()):
        if props.get(name) is False:
            return True
        if closed and name not in props and not any(_search(p, name) for p in patterns):
            return True
    return False


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


def short_reason(message: str) -> str:
    """llguidance's message; of a bad regex, its first line and the regex parser's verdict."""
    lines = message.strip().splitlines()
    verdict = next((x for x in lines if x.startswith("error: ")), None)
    if verdict is None:
        return lines[0]
    verdict = verdict.removeprefix("error: ")
    return f"{lines[0]} {verdict[:1].upper()}{verdict[1:]}"


def locate(schema: Any, key: str, path: str = "") -> str:
    """Where in `schema` the keyword `key` first appears ("/" for the root)."""
    if isinstance(schema, dict):
        if key in schema:
            return path or "/"
        items: list[tuple[str, Any]] = list(schema.items())
    elif isinstance(schema, list):
        items = [(str(i), v) for i, v in enumerate(schema)]
    else:
        return ""
    for name, sub in items:
        found = locate(sub, key, f"{path}/{name}")
        if found:
            return found
    return "" if path else "/"
