"""Which JSON schemas are refused before compiling, judged against llguidance itself: every
keyword refused as "not enforced" is one llguidance alone silently lets through (so the refusal
is needed); keywords it enforces pass (also those an earlier engine ignored), annotations never
cause a refusal; llguidance's own refusals name the place; the schemas of the test set compile;
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
from structured_schemas import ACCEPTED, CASES, REFUSED

from minisgl.constrain import GrammarCompiler, GrammarError, RequestGrammar
from minisgl.constrain.schema import (
    JSON_OPTIONS,
    KNOWN_FORMATS,
    UnenforceableSchema,
    for_llguidance,
    prepare,
)
from minisgl.core import Constraint, InvalidRequestError

VOCAB = 49152
EOS = 2
INT = {"type": "integer"}


def obj(props: dict[str, Any], required: list[str] | None = None, **kw: Any) -> dict[str, Any]:
    req = list(props) if required is None else required
    return {"type": "object", "properties": props, "required": req, **kw}


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(lambda: tokenizer, VOCAB, end_token=EOS)


def accepts(compiler: GrammarCompiler, tokenizer: Any, grammar: str, text: str) -> bool:
    """Whether the llguidance grammar `grammar` takes `text` whole (and may end there)."""
    from minisgl.constrain.grammar import Compiled

    backend = compiler.backend
    g = RequestGrammar(Compiled(backend, backend.compile(grammar, "json_schema")), [EOS])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return all(g.accept(t) for t in ids) and g.accept(EOS)


def raw_accepts(compiler: GrammarCompiler, tokenizer: Any, schema: Any, text: str) -> bool:
    """Whether llguidance's grammar of `schema`, with no preparation or check before it (only
    the JSON options), takes `text`."""
    from llguidance import LLMatcher

    grammar = LLMatcher.grammar_from_json_schema({**schema, "x-guidance": JSON_OPTIONS})
    return accepts(compiler, tokenizer, grammar, text)


def prepared_accepts(compiler: GrammarCompiler, tokenizer: Any, schema: Any, text: str) -> bool:
    from llguidance import LLMatcher

    return accepts(
        compiler, tokenizer, LLMatcher.grammar_from_json_schema(for_llguidance(schema)), text
    )


DRAFT7 = "http://json-schema.org/draft-07/schema#"
# (schema, an instance it rejects, the schema that says so when not itself): llguidance alone
# accepts each instance. `additionalItems` means something only in draft 7 (where `items` is
# the list): a schema that writes it means it.
NOT_ENFORCED = {
    "additionalItems": (
        {"type": "array", "prefixItems": [INT], "additionalItems": False},
        "[1, 2]",
        {"$schema": DRAFT7, "type": "array", "items": [INT], "additionalItems": False},
    ),
    "overlapping oneOf": (obj({"a": {"oneOf": [INT, {"type": "number"}]}}), '{"a": 1}', None),
}


@pytest.mark.parametrize("name", list(NOT_ENFORCED))
def test_refused_keywords_are_really_ignored_by_llguidance(
    compiler: GrammarCompiler, tokenizer: Any, name: str
) -> None:
    schema, text, reference = NOT_ENFORCED[name]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(text), reference or schema)
    assert raw_accepts(compiler, tokenizer, schema, text), "llguidance enforces it now"
    with pytest.raises(UnenforceableSchema):
        prepare(schema)


# (schema, where the keyword is): keywords llguidance does not implement; it refuses them itself.
BACKEND_REFUSES = {
    "uniqueItems": (
        obj({"a": {"type": "array", "items": INT, "uniqueItems": True}}),
        "/properties/a",
    ),
    "not": (obj({"a": {"not": {"type": "string"}}}), "/properties/a"),
    "if": ({**obj({"a": INT}), "if": {"required": ["a"]}, "then": {}}, "/"),
    "contains": (
        obj({"a": {"type": "array", "items": INT, "contains": {"const": 3}}}),
        "/properties/a",
    ),
    "unevaluatedProperties": (
        {"type": "object", "properties": {"a": INT}, "unevaluatedProperties": False},
        "/",
    ),
}


@pytest.mark.parametrize("name", list(BACKEND_REFUSES))
def test_what_llguidance_does_not_implement_is_refused_with_its_place(
    compiler: GrammarCompiler, name: str
) -> None:
    schema, where = BACKEND_REFUSES[name]
    prepare(schema)  # nothing of ours refuses it
    with pytest.raises(GrammarError) as e:
        compiler.compile(Constraint("json_schema", json.dumps(schema)))
    assert e.value.reason == f"at {where}: `{name}` is not enforced; remove it", e.value.reason


# (schema, an instance it rejects): llguidance refuses each instance, so these are accepted.
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
    "propertyNames enum": (
        {"type": "object", "propertyNames": {"enum": ["a", "b"]}, "additionalProperties": INT},
        '{"c": 1}',
    ),
    "minProperties": (
        {"type": "object", "additionalProperties": INT, "minProperties": 2},
        '{"a": 1}',
    ),
    "patternProperties": (
        {"type": "object", "patternProperties": {"^a": INT}, "additionalProperties": False},
        '{"b": 1}',
    ),
    "discriminated oneOf": (
        obj({"s": {"oneOf": [obj({"k": {"const": "a"}, "x": INT}), obj({"k": {"const": "b"}})]}}),
        '{"s": {"k": "a"}}',
    ),
    "format and maxLength": (
        obj({"a": {"type": "string", "format": "email", "maxLength": 5}}),
        '{"a": "abcdefgh@x.com"}',
    ),
    "pattern and format": (
        obj({"a": {"type": "string", "format": "email", "pattern": "^z"}}),
        '{"a": "a@b.com"}',
    ),
    "untyped maxLength": (obj({"a": {"maxLength": 3}}), '{"a": "abcdef"}'),
    "untyped minItems": (obj({"a": {"minItems": 3}}), '{"a": []}'),
    "untyped multipleOf": (obj({"x": {"multipleOf": 5}}), '{"x": 3}'),
    **{name: (schema, bad) for name, schema, bad in ACCEPTED},
}


@pytest.mark.parametrize("name", list(ENFORCED))
def test_enforced_keywords_pass(compiler: GrammarCompiler, tokenizer: Any, name: str) -> None:
    schema, text = ENFORCED[name]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(text), schema)
    assert not prepared_accepts(compiler, tokenizer, schema, text)
    compiler.compile(Constraint("json_schema", json.dumps(schema)))


DRAFT4 = "http://json-schema.org/draft-04/schema#"
STR = {"type": "string"}
# (schema, an instance it takes, one it rejects): schemas of kinds real ones hold (draft-4 and
# draft-7 schemas from GitHub, a forbidden property written `not: {}`, `oneOf` of object shapes)
# that were once refused: each keyword constrains nothing, or is served in 2020-12's words.
LIFTED = {
    "draft 4 boolean exclusiveMinimum": (
        {
            "$schema": DRAFT4,
            **obj({"a": {"type": "integer", "minimum": 3, "exclusiveMinimum": True}}),
        },
        '{"a": 4}',
        '{"a": 3}',
    ),
    "draft 7 list of items": (
        {
            "$schema": DRAFT7,
            **obj({"a": {"type": "array", "items": [INT, STR], "additionalItems": False}}),
        },
        '{"a": [1, "x"]}',
        '{"a": [1, "x", 2]}',
    ),
    "additionalItems beside one schema of items": (
        obj({"a": {"type": "array", "items": INT, "additionalItems": False}}),
        '{"a": [1, 2]}',
        '{"a": ["x"]}',
    ),
    "uniqueItems false": (
        obj({"a": {"type": "array", "items": INT, "uniqueItems": False}}),
        '{"a": [1, 1]}',
        '{"a": ["x"]}',
    ),
    "not {}": (obj({"a": INT, "b": {"not": {}}}, ["a"]), '{"a": 1}', '{"a": 1, "b": 2}'),
    "oneOf of objects told apart by a required property": (
        obj({"s": {"oneOf": [obj({"a": STR}), obj({"b": INT})]}}),
        '{"s": {"b": 1}}',
        '{"s": {"a": "x", "b": 1}}',
    ),
    "dependentRequired": (
        {**obj({"a": INT, "b": INT}, []), "dependentRequired": {"a": ["b"]}},
        '{"a": 1, "b": 2}',
        '{"a": 1}',
    ),
    "dependentSchemas": (
        {**obj({"a": INT, "b": INT}, []), "dependentSchemas": {"a": {"required": ["b"]}}},
        '{"b": 2}',
        '{"a": 1}',
    ),
    "draft 7 dependencies: properties that exclude each other": (
        {
            "$schema": DRAFT7,
            **obj({"x": STR, "y": STR}, []),
            "dependencies": {
                "x": {"properties": {"y": {"not": {}}}},
                "y": {"properties": {"x": {"not": {}}}},
                "z": ["x"],
            },
        },  # fmt: skip
        '{"y": "q"}',
        '{"x": "p", "y": "q"}',
    ),
    "dependencies: a choice of the object around it": (
        {
            "$schema": DRAFT7,
            **obj({"f": {"type": "boolean"}, "n": INT, "s": STR}, []),
            "dependencies": {
                "f": {
                    "anyOf": [
                        {"properties": {"n": {"not": {}}}, "required": ["s"]},
                        {"properties": {"f": {"const": False}}},
                    ]
                }
            },
        },  # fmt: skip
        '{"f": true, "s": "x"}',
        '{"f": true, "n": 1}',
    ),
    "oneOf of choices that each require one name": (
        {
            **obj({"a": STR, "b": STR, "c": INT}, []),
            "oneOf": [{"required": ["a"]}, {"required": ["b"], "description": "or b"}],
        },  # fmt: skip
        '{"b": "y", "c": 1}',
        '{"a": "x", "b": "y"}',
    ),
    "oneOf of untyped choices under an object type": (
        {
            "type": "object",
            "properties": {"a": STR, "b": INT},
            "oneOf": [
                {"required": ["a"], "properties": {"a": STR}},
                {"required": ["b"], "properties": {"b": INT}},
            ],
        },  # fmt: skip
        '{"a": "x"}',
        '{"a": "x", "b": 1}',
    ),
}


@pytest.mark.parametrize("name", list(LIFTED))
def test_schemas_once_refused_are_enforced(
    compiler: GrammarCompiler, tokenizer: Any, name: str
) -> None:
    schema, good, bad = LIFTED[name]
    jsonschema.validate(json.loads(good), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(bad), schema)
    compiler.compile(Constraint("json_schema", json.dumps(schema)))
    assert prepared_accepts(compiler, tokenizer, schema, good)
    assert not prepared_accepts(compiler, tokenizer, schema, bad)


def test_what_llguidance_alone_refuses_is_rewritten() -> None:
    """`not: {}`, `uniqueItems: false` and the dependency keywords are refused by llguidance
    itself (so rewritten, not passed on); draft 3 is refused."""
    from llguidance import LLMatcher

    for name in ("not {}", "uniqueItems false", "dependentRequired", "dependentSchemas"):
        grammar = LLMatcher.grammar_from_json_schema(LIFTED[name][0])
        assert LLMatcher.validate_grammar_with_warnings(grammar)[0], name
    with pytest.raises(UnenforceableSchema, match="draft 3"):
        prepare({"$schema": "http://json-schema.org/draft-03/schema#", "type": "string"})


def test_an_object_naming_its_properties_takes_no_others(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    """Without `additionalProperties`, an object with `properties` takes no other property
    (the README's semantics; JSON Schema's would allow any); with it, what it says."""
    closed = obj({"a": INT}, required=[])
    assert not prepared_accepts(compiler, tokenizer, closed, '{"a": 1, "b": 2}')
    assert prepared_accepts(compiler, tokenizer, closed, '{"a": 1}')
    opened = {**closed, "additionalProperties": {"type": "string"}}
    assert prepared_accepts(compiler, tokenizer, opened, '{"a": 1, "b": "x"}')
    assert not prepared_accepts(compiler, tokenizer, opened, '{"a": 1, "b": 2}')
    assert prepared_accepts(compiler, tokenizer, {"type": "object"}, '{"b": [1]}')  # JSON mode


ANNOTATED = {
    "type": "object",
    "title": "t",
    "description": "d",
    "$comment": "c",
    "properties": {
        "kind": {"enum": ["a", "b"], "readOnly": True, "description": "which"},
        "n": {"type": "integer", "default": 1, "examples": [1, 2], "deprecated": True},
        "s": {"type": "string", "writeOnly": True, "title": "s", "format": "x-made-up"},
    },
    "required": ["kind", "n"],
}


def test_annotations_never_cause_a_refusal(compiler: GrammarCompiler, tokenizer: Any) -> None:
    """Annotation keywords beside any other (`readOnly` beside `enum`), and formats llguidance
    does not know (annotations, as in JSON Schema 2020-12), compile; the rest is enforced."""
    compiler.compile(Constraint("json_schema", json.dumps(ANNOTATED)))
    assert prepared_accepts(compiler, tokenizer, ANNOTATED, '{"kind": "a", "n": 3, "s": "z"}')
    assert not prepared_accepts(compiler, tokenizer, ANNOTATED, '{"kind": "c", "n": 3}')


def test_the_formats_kept_are_the_ones_llguidance_enforces(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    from llguidance import LLMatcher

    for f in KNOWN_FORMATS:
        schema = {"type": "string", "format": f, "x-guidance": JSON_OPTIONS}
        grammar = LLMatcher.grammar_from_json_schema(schema)
        assert not LLMatcher.validate_grammar_with_warnings(grammar)[0], f
        assert not accepts(compiler, tokenizer, grammar, '"@ not a value of any format"'), f
    unknown = LLMatcher.grammar_from_json_schema({"type": "string", "format": "uri-reference"})
    assert LLMatcher.validate_grammar_with_warnings(unknown)[0]  # so it is dropped


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
            prepare(schema)
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
