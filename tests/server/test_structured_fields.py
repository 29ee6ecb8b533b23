"""The request fields of structured outputs and `logit_bias`, from parsed body to
`SamplingParams` (no server: the bodies the openai client sends, checked by the API's own
models): which constraint a request asks for, the field an error names, and what is refused."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from minisgl.core import JSON_OBJECT, Constraint
from minisgl.server.errors import ApiError
from minisgl.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from minisgl.server.sampling import sampling_params

MSG = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**fields: Any) -> tuple[Constraint | None, str | None]:
    body = ChatCompletionRequest.model_validate({"messages": MSG, **fields})
    params, field = sampling_params(body, False, 0)
    return params.constraint, field


def native(**sp: Any) -> tuple[Constraint | None, str | None]:
    body = GenerateRequest.model_validate({"text": "hi", "sampling_params": sp})
    params, field = sampling_params(body.sampling_params, False, 0)
    return params.constraint, field


def refused(make: Any) -> ApiError:
    with pytest.raises(ApiError) as e:
        make()
    assert e.value.status == 400
    return e.value


def test_response_format_becomes_the_request_constraint() -> None:
    assert chat() == (None, None)
    assert chat(response_format={"type": "text"}) == (None, None)
    assert chat(response_format={"type": "json_object"}) == (JSON_OBJECT, "response_format")
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
    constraint, field = chat(response_format=fmt)
    assert constraint is not None and constraint.kind == "json_schema"
    assert json.loads(constraint.text) == SCHEMA
    assert field == "response_format.json_schema.schema"
    assert chat(regex="[0-9]+") == (Constraint("regex", "[0-9]+"), "regex")
    assert chat(ebnf='root ::= "a"') == (Constraint("ebnf", 'root ::= "a"'), "ebnf")
    body = CompletionRequest.model_validate({"prompt": "hi", "regex": "a|b"})
    assert sampling_params(body, False, 0).params.constraint == Constraint("regex", "a|b")


def test_native_sampling_params_take_a_schema_as_text_or_object() -> None:
    text = json.dumps(SCHEMA)
    assert native(json_schema=text) == (Constraint("json_schema", text), "json_schema")
    constraint, _ = native(json_schema=SCHEMA)
    assert constraint is not None and json.loads(constraint.text) == SCHEMA
    assert native(regex="x+") == (Constraint("regex", "x+"), "regex")


def test_the_openai_clients_parse_body_is_accepted() -> None:
    """What `chat.completions.parse(response_format=Model)` sends."""
    from openai.lib._parsing._completions import type_to_response_format_param

    class Answer(BaseModel):
        city: str
        population: int | None

    fmt = type_to_response_format_param(Answer)
    constraint, field = chat(response_format=fmt)
    assert constraint is not None and json.loads(constraint.text)["title"] == "Answer"
    assert field == "response_format.json_schema.schema"


def test_at_most_one_constraint() -> None:
    e = refused(lambda: chat(response_format={"type": "json_object"}, regex="a"))
    assert e.param == "regex"
    assert e.message == "regex: at most one constraint per request, got response_format and regex"
    assert refused(lambda: native(json_schema="{}", ebnf='root ::= "a"')).param == "ebnf"
    assert refused(lambda: chat(regex="a", ebnf='root ::= "a"')).param == "ebnf"


def test_bad_shapes_name_their_field() -> None:
    assert refused(lambda: chat(regex="")).message == "regex: must be a non-empty string"
    e = refused(lambda: native(json_schema="{'a': 1}"))
    assert e.param == "json_schema" and e.message.startswith("json_schema: not valid JSON")
    assert refused(lambda: native(json_schema="[1]")).message == (
        "json_schema: must be a JSON object"
    )
    for fmt in [
        {"type": "json_schema"},  # no json_schema
        {"type": "text", "json_schema": {"name": "a", "schema": {}}},
        {"type": "json_schema", "json_schema": {"name": "a"}},  # no schema
        {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "extra": 1}},
        {"type": "yaml"},
    ]:
        with pytest.raises(ValidationError):
            chat(response_format=fmt)


def test_logit_bias_keys_are_token_ids_and_values_in_range() -> None:
    body = ChatCompletionRequest.model_validate({"messages": MSG, "logit_bias": {"7": -100}})
    assert sampling_params(body, False, 0).params.logit_bias == ((7, -100.0),)
    for bias, why in [
        ({"hello": 1}, "logit_bias: 'hello' is not a token id"),
        ({"-3": 1}, "logit_bias: '-3' is not a token id"),
        ({"7": 100.5}, "logit_bias: the bias of token 7 must be in [-100, 100], got 100.5"),
    ]:
        e = refused(lambda b=bias: chat(logit_bias=b))
        assert (e.param, e.message) == ("logit_bias", why)
