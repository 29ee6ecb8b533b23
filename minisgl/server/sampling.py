"""Request ids, per-choice seeds and `SamplingParams` from the API's sampling fields."""

from __future__ import annotations

import json
import random
import uuid
from typing import Any, NamedTuple

from minisgl.core import JSON_OBJECT, InvalidRequestError, SamplingParams
from minisgl.message import GenerateReq
from minisgl.server.errors import ApiError, error_param
from minisgl.server.protocol import NativeSamplingParams, SamplingFields

MAX_STOPS = 16


def new_rid() -> str:
    return uuid.uuid4().hex


def choice_seeds(seed: int | None, n: int) -> list[int]:
    """Choice i samples with seed + i (wrapped to int64), or with a fresh random seed."""
    if seed is None:
        return [random.getrandbits(63) for _ in range(n)]
    return [(seed + i + 2**63) % 2**64 - 2**63 for i in range(n)]


def generate_req(
    n: int,
    seed: int | None,
    params: SamplingParams,
    max_tokens: int | None,
    grammar_field: str | None,
    **prompt: Any,
) -> GenerateReq:
    """One prompt's request for `n` choices; `prompt`: its `text`, `input_ids` or `messages`
    (and `chat`)."""
    base = new_rid()
    rids = [base] if n == 1 else [f"{base}-{i}" for i in range(n)]
    return GenerateReq(rids, choice_seeds(seed, n), params, max_tokens, **prompt,
                       grammar_field=grammar_field)  # fmt: skip


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop: at most {MAX_STOPS} stop strings, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise ApiError(400, "stop: stop strings must not be empty", "stop")
    return stops


class GrammarField(NamedTuple):
    """The grammar a request asks for: its kind (a `SamplingParams` field), its text, and the
    request field it came from (named in errors)."""

    kind: str
    text: str
    field: str


def request_grammar(body: SamplingFields | NativeSamplingParams) -> GrammarField | None:
    """The one grammar among `response_format` (OpenAI), `json_schema` (native), `regex` and
    `ebnf`; a 400 naming them when more than one is given."""
    given: list[GrammarField] = []
    if isinstance(body, SamplingFields):
        rf = body.response_format
        if rf is not None and rf.type == "json_object":
            given.append(GrammarField("json_schema", JSON_OBJECT.text, "response_format"))
        elif rf is not None and rf.json_schema is not None:
            text = json.dumps(rf.json_schema.schema_)
            given.append(GrammarField("json_schema", text, "response_format.json_schema.schema"))
    elif body.json_schema is not None:
        schema = body.json_schema
        text = schema if isinstance(schema, str) else json.dumps(schema)
        given.append(GrammarField("json_schema", text, "json_schema"))
    for kind in ("regex", "ebnf"):
        text = getattr(body, kind)
        if text is not None:
            given.append(GrammarField(kind, text, kind))
    if len(given) > 1:
        names = " and ".join(g.field.split(".")[0] for g in given)
        field = given[1].field.split(".")[0]
        raise ApiError(400, f"{field}: at most one constraint per request, got {names}", field)
    return given[0] if given else None


class Sampling(NamedTuple):
    params: SamplingParams
    grammar_field: str | None  # the request field its grammar came from, if it has one


def sampling_params(
    body: SamplingFields | NativeSamplingParams,
    logprobs: bool,
    top_logprobs: int,
    grammar: GrammarField | None = None,
) -> Sampling:
    """The body's sampling fields checked by `SamplingParams` (`max_tokens` travels apart,
    since the default depends on the prompt's length); `grammar`: one that replaces the body's
    own (a forced tool call's)."""
    grammar = grammar if grammar is not None else request_grammar(body)
    constraint: dict[str, Any] = {grammar.kind: grammar.text} if grammar is not None else {}
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    try:
        params = SamplingParams(
            # The tokenizer sets max_tokens once it knows the prompt's length (and checks
            # min_tokens against it then); until then it only must not be below min_tokens.
            max_tokens=max(1, body.min_tokens),
            temperature=temperature,
            top_p=top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            seed=body.seed,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            skip_special_tokens=body.skip_special_tokens,
            stop=stop_strings(body.stop),
            min_tokens=body.min_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logit_bias=logit_bias(body.logit_bias),
            **constraint,
            priority=body.priority,
        )
    except InvalidRequestError as e:  # a grammar's error names the request field it came from
        if grammar is not None and str(e).startswith(f"{grammar.kind}:"):
            raise ApiError(400, grammar.field + str(e)[len(grammar.kind) :], grammar.field) from e
        raise ApiError(400, str(e), error_param(str(e))) from e
    return Sampling(params, grammar.field if grammar is not None else None)


def logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's map (token ids as strings) as (id, bias) pairs; the ids must be numerals."""
    pairs = []
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise ApiError(400, f"logit_bias: {key!r} is not a token id", "logit_bias")
        pairs.append((int(key), value))
    return tuple(pairs)
