"""Which JSON schemas are refused before compiling, judged against xgrammar itself: for every
keyword refused as "not enforced", xgrammar alone lets through an instance the schema rejects
(so the refusal is needed); keywords it does enforce pass; the schemas of the test set compile;
malformed schemas are refused by the meta-schema; random schemas give a GrammarError or
compile, never anything else."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structured_schemas import CASES, REFUSED

from minisgl.constrain import GrammarCompiler, GrammarError, RequestGrammar
from minisgl.constrain.grammar import JSON_MAX_WHITESPACE
from minisgl.constrain.schema import UnenforceableSchema, check_enforceable
from minisgl.core import Constraint, InvalidRequestError

VOCAB = 49152
EOS = 2
INT = {"type": "integer"}


def obj(props: dict[str, Any], required: list[str] | None = None, **kw: Any) -> dict[str, Any]:
    req = list(props) if required is None else required
    return {"type": "object", "properties": props, "required": req, **kw}


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(lambda: tokenizer, VOCAB, stop_ids=[EOS])


def xgrammar_accepts(compiler: GrammarCompiler, tokenizer: Any, schema: Any, text: str) -> bool:
    """Whether xgrammar's grammar for `schema`, compiled with no check before it, takes `text`
    whole (and may end there)."""
    import xgrammar as xgr

    raw = xgr.GrammarCompiler(compiler.tokenizer_info()).compile_json_schema(
        json.dumps(schema), any_whitespace=True, max_whitespace_cnt=JSON_MAX_WHITESPACE
    )
    g = RequestGrammar(raw, [EOS])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return all(g.accept(t) for t in ids) and g.accept(EOS)


# (schema, an instance it rejects): xgrammar alone accepts each instance.
NOT_ENFORCED = {
    "uniqueItems": (
        obj({"a": {"type": "array", "items": INT, "uniqueItems": True}}),
        '{"a": [1, 1]}',
    ),
    "allOf": ({"allOf": [obj({"a": INT}), {"required": ["a"]}]}, '{"b": 1}'),
    "not": (obj({"a": {"not": {"type": "string"}}}), '{"a": "x"}'),
    "if": (
        {**obj({"a": INT, "b": INT}, ["a"]), "if": {"properties": {"a": {"const": 1}}}}
        | {"then": {"required": ["b"]}},
        '{"a": 1}',
    ),
    "dependentRequired": (
        {**obj({"a": INT, "b": INT}, []), "dependentRequired": {"a": ["b"]}},
        '{"a": 1}',
    ),
    "contains": ({"type": "array", "items": INT, "contains": {"const": 3}}, "[1]"),
    "number multipleOf": (obj({"x": {"type": "number", "multipleOf": 0.5}}), '{"x": 0.3}'),
    "untyped multipleOf": (obj({"x": {"multipleOf": 5}}), '{"x": 3}'),
    "beside $ref": (
        {"$defs": {"n": INT}, **obj({"a": {"$ref": "#/$defs/n", "minimum": 3}})},
        '{"a": 1}',
    ),
    "beside anyOf": (
        obj({"a": {"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": 0}]}}),
        '{"a": "s"}',
    ),
    "overlapping oneOf": (obj({"a": {"oneOf": [INT, {"type": "number"}]}}), '{"a": 1}'),
    "pattern and maxLength": (
        obj({"a": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 5}}),
        '{"a": "abcdefgh"}',
    ),
    "format and maxLength": (
        obj({"a": {"type": "string", "format": "email", "maxLength": 5}}),
        '{"a": "abcdefgh@x.com"}',
    ),
    "pattern and format": (
        obj({"a": {"type": "string", "format": "email", "pattern": "^z"}}),
        '{"a": "a@b.com"}',
    ),
    "untyped minimum": (obj({"a": {"minimum": 3}}), '{"a": 1}'),
    "untyped maxLength": (obj({"a": {"maxLength": 3}}), '{"a": "abcdef"}'),
    "untyped minItems": (obj({"a": {"minItems": 3}}), '{"a": []}'),
    "required, undefined": (obj({"a": INT}, ["a", "b"]), '{"a": 1}'),
    "enum of another type": (obj({"a": {"type": "string", "enum": ["x", 1]}}), '{"a": 1}'),
}


@pytest.mark.parametrize("name", list(NOT_ENFORCED))
def test_refused_keywords_are_really_ignored_by_xgrammar(
    compiler: GrammarCompiler, tokenizer: Any, name: str
) -> None:
    schema, text = NOT_ENFORCED[name]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(text), schema)
    assert xgrammar_accepts(compiler, tokenizer, schema, text), "xgrammar enforces it now"
    with pytest.raises(UnenforceableSchema):
        check_enforceable(schema)


# (schema, an instance it rejects): xgrammar refuses each, so these schemas are accepted.
ENFORCED = {
    "integer multipleOf": (obj({"x": {"type": "integer", "multipleOf": 5}}), '{"x": 3}'),
    "exclusiveMinimum": (obj({"a": {"type": "integer", "exclusiveMinimum": 3}}), '{"a": 3}'),
    "number minimum": (obj({"a": {"type": "number", "minimum": 1.5}}), '{"a": 1.2}'),
    "bounds of a type list": (obj({"a": {"type": ["integer", "null"], "minimum": 3}}), '{"a": 1}'),
    "const beside type": (obj({"a": {"type": "integer", "const": 2}}), '{"a": 3}'),
    "untyped propertyNames": (
        {"type": "object", "propertyNames": {"pattern": "^[a-z]$"}, "additionalProperties": INT},
        '{"AB": 1}',
    ),
    "minProperties": (
        {"type": "object", "additionalProperties": INT, "minProperties": 2},
        '{"a": 1}',
    ),
    "patternProperties": (
        {"type": "object", "patternProperties": {"^a": INT}, "additionalProperties": False},
        '{"b": 1}',
    ),
    "unevaluatedProperties": (
        {"type": "object", "properties": {"a": INT}, "unevaluatedProperties": False},
        '{"b": 1}',
    ),
    "discriminated oneOf": (
        obj({"s": {"oneOf": [obj({"k": {"const": "a"}, "x": INT}), obj({"k": {"const": "b"}})]}}),
        '{"s": {"k": "a"}}',
    ),
}


@pytest.mark.parametrize("name", list(ENFORCED))
def test_enforced_keywords_pass(compiler: GrammarCompiler, tokenizer: Any, name: str) -> None:
    schema, text = ENFORCED[name]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(text), schema)
    assert not xgrammar_accepts(compiler, tokenizer, schema, text)
    check_enforceable(schema)


def test_every_schema_of_the_test_set_compiles(compiler: GrammarCompiler) -> None:
    assert len(CASES) >= 40
    for case in CASES:
        compiler.compile(Constraint("json_schema", json.dumps(case.schema)))


@pytest.mark.parametrize(("name", "schema", "why"), REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_schemas_say_where_and_why(
    compiler: GrammarCompiler, name: str, schema: dict[str, Any], why: str
) -> None:
    with pytest.raises(GrammarError) as e:
        compiler.compile(Constraint("json_schema", json.dumps(schema)))
    assert e.value.kind == "json_schema" and why in e.value.reason, e.value.reason


def test_malformed_schemas_are_refused_by_the_meta_schema() -> None:
    for schema, where in [
        ({"type": [["string"]]}, "at /type:"),
        ({"type": "object", "required": [1]}, "at /required/0:"),
        ({"properties": {"a": {"minimum": "3"}}}, "at /properties/a/minimum:"),
        (
            {"type": "object", "properties": {"a": {"enum": [{}], "type": {}}}},
            "at /properties/a/type:",
        ),
    ]:
        with pytest.raises(UnenforceableSchema, match="not a valid JSON Schema") as e:
            check_enforceable(schema)
        assert str(e.value).startswith(where), str(e.value)


_KEYS = ["type", "properties", "required", "items", "prefixItems", "anyOf", "oneOf", "enum"]
_KEYS += ["const", "$ref", "$defs", "minimum", "maximum", "pattern", "format", "maxLength"]
_KEYS += ["additionalProperties", "minItems", "propertyNames", "multipleOf", "a", "b"]
_LEAVES = st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False)
_LEAVES |= st.sampled_from(["string", "integer", "object", "array", "null", "#", "#/$defs/a"])
_LEAVES |= st.sampled_from(["date", "email", "^[a-z]$", "(", "a"])
SCHEMAS = st.recursive(
    _LEAVES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(_KEYS), inner),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=SCHEMAS)
def test_random_schemas_compile_or_give_a_grammar_error(
    compiler: GrammarCompiler, schema: Any
) -> None:
    try:
        constraint = Constraint("json_schema", json.dumps(schema))
    except InvalidRequestError:
        return  # not an object: refused before compiling
    with contextlib.suppress(GrammarError):  # anything else fails the test
        compiler.compile(constraint)
