"""Structured outputs and `logit_bias` through a real server process (the real SmolLM2 model),
driven with the `openai` client and raw HTTP: a set of JSON schemas of the kinds real APIs use
(answered at once, in one batch), JSON mode, regexes, an EBNF grammar, the SDK's typed `parse`
path, streaming, and bad schemas, regexes and grammars refused with a 400 that says why while
the server keeps serving everyone else."""

from __future__ import annotations

import ast
import asyncio
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from serving_helpers import Server, running_server
from structured_schemas import ACCEPTED, CASES, REFUSED
from test_api import assert_pool_clean, wait_idle

pytestmark = pytest.mark.slow  # a server of its own: tens of seconds to start

SCHEMA_FIELD = "response_format.json_schema.schema"
MAX_TOKENS = 160  # room for every schema of the set; one that idles ends with "length"
TIMEOUT_S = 900  # a 2-core machine shared with other work can be slow
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("logs")) as server:
        yield server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.openai(timeout=TIMEOUT_S)  # type: ignore[return-value]


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with server.http(timeout=TIMEOUT_S) as c:
        yield c


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def schema_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def at_once(server: Server, path: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each body's first choice, the requests sent together (so they share batches)."""

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT_S) as c:
            return await asyncio.gather(*(c.post(path, json=b) for b in bodies))

    answers = asyncio.run(run())
    for r in answers:
        assert r.status_code == 200, r.text
    return [r.json()["choices"][0] for r in answers]


def valid(text: str, schema: dict[str, Any]) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


# ---- JSON schemas ------------------------------------------------------------------------------


def test_a_set_of_schemas_gives_answers_that_validate(server: Server) -> None:
    """Every schema of the set at once (one batch): at least 90% end with "stop", and every
    answer that does parses and validates."""

    async def ask(c: openai.AsyncOpenAI, case: Any) -> tuple[str, str, str]:
        r = await c.chat.completions.create(
            model="default",
            messages=user(case.prompt + " Answer in JSON."),  # type: ignore[arg-type]
            response_format=schema_format(case.name, case.schema),  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        choice = r.choices[0]
        return case.name, str(choice.finish_reason), choice.message.content or ""

    async def ask_all() -> list[tuple[str, str, str]]:
        c: openai.AsyncOpenAI = server.async_openai(TIMEOUT_S)  # type: ignore[assignment]
        async with c:
            return await asyncio.gather(*(ask(c, case) for case in CASES))

    answers = asyncio.run(ask_all())
    assert len(answers) >= 40
    schemas = {case.name: case.schema for case in CASES}
    stopped = [(name, text) for name, reason, text in answers if reason == "stop"]
    assert {reason for _, reason, _ in answers} <= {"stop", "length"}
    summary = "\n".join(f"{n}: {r} {t!r}" for n, r, t in answers)
    assert len(stopped) >= 0.9 * len(answers), summary
    for name, text in stopped:
        try:
            valid(text, schemas[name])
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            raise AssertionError(f"{name}: {text!r}: {e}") from None


@pytest.mark.parametrize(("name", "schema", "why"), REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_schemas_get_a_400_that_says_why(
    http: httpx.Client, name: str, schema: dict[str, Any], why: str
) -> None:
    body = {"messages": user("Hi"), "response_format": schema_format(name, schema)}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == SCHEMA_FIELD
    assert err["message"].startswith(f"{SCHEMA_FIELD}: ") and why in err["message"], err


@pytest.mark.parametrize(("name", "schema", "bad"), ACCEPTED, ids=[r[0] for r in ACCEPTED])
def test_schemas_once_refused_are_served(
    http: httpx.Client, name: str, schema: dict[str, Any], bad: str
) -> None:
    """Keywords the engine enforces are not refused: the answer is valid (or cut by length)."""
    body = {"messages": user("Answer in JSON."), "response_format": schema_format(name, schema)}
    r = http.post("/v1/chat/completions", json=body | {"max_tokens": 60, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        valid(choice["message"]["content"], schema)
    else:
        assert choice["finish_reason"] == "length", choice


def test_json_mode_answers_json_objects(server: Server) -> None:
    prompts = [
        "Give a JSON object with the name and age of a person called Ann.",
        "Return a JSON object with the keys city and country for Tokyo.",
        "Give a JSON object describing a book with its title and author.",
    ]
    bodies = [
        {"messages": user(p), "response_format": {"type": "json_object"}, "max_tokens": 120}
        | {"temperature": 0}
        for p in prompts
    ]
    for choice in at_once(server, "/v1/chat/completions", bodies):
        assert choice["finish_reason"] == "stop", choice
        assert isinstance(json.loads(choice["message"]["content"]), dict), choice


# ---- regexes and grammars ----------------------------------------------------------------------

REGEXES = [
    ("Today's date is ", r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
    ("Call our office at ", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
    ("The server's IP address is ", r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}"
     r"(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])"),
]  # fmt: skip


def test_regexes_match_on_both_endpoints(server: Server) -> None:
    plain = [
        {"prompt": prompt, "max_tokens": 40, "temperature": 0, "regex": regex}
        for prompt, regex in REGEXES
    ]
    chats = [
        {"messages": user(prompt.strip() + "?"), "max_tokens": 40, "seed": 3, "regex": regex}
        for prompt, regex in REGEXES
    ]
    done = at_once(server, "/v1/completions", plain)
    said = at_once(server, "/v1/chat/completions", chats)
    for (_, regex), d, s in zip(REGEXES, done, said):
        assert d["finish_reason"] == "stop" and re.fullmatch(regex, d["text"]), d
        text = s["message"]["content"]
        assert s["finish_reason"] == "stop" and re.fullmatch(regex, text), s


# Arithmetic with bounded repetition and one level of parentheses, so that every answer ends
# well within MAX_TOKENS.
ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor (("*" | "/") factor){0,2}
factor ::= num | "(" num (("+" | "-") num){1,2} ")"
num ::= [1-9] [0-9]{0,2}
"""
ARITHMETIC_NODES = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)


def is_arithmetic(text: str) -> bool:
    tree = ast.parse(text, mode="eval")
    return all(isinstance(n, ARITHMETIC_NODES) for n in ast.walk(tree)) and " " not in text


def test_an_ebnf_grammar_gives_arithmetic_expressions(
    server: Server, client: openai.OpenAI, http: httpx.Client
) -> None:
    sp = {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ebnf": ARITHMETIC}
    r = http.post(
        "/generate", json={"text": "An expression that equals 10: ", "sampling_params": sp}
    )
    out = r.json()
    assert out["meta_info"]["finish_reason"] == "stop" and is_arithmetic(out["text"]), out
    body = {"messages": user("Write a sum whose result is 42."), "max_tokens": MAX_TOKENS}
    bodies = [{**body, "seed": seed, "ebnf": ARITHMETIC} for seed in range(3)]
    for choice in at_once(server, "/v1/chat/completions", bodies):
        assert choice["finish_reason"] == "stop", choice
        assert is_arithmetic(choice["message"]["content"]), choice
    choice = client.chat.completions.create(  # the openai client's way to send it
        model="default",
        messages=user("Write a product of two numbers."),  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ebnf": ARITHMETIC},
    ).choices[0]
    assert choice.finish_reason == "stop" and is_arithmetic(choice.message.content or "")


# ---- the openai client ------------------------------------------------------------------------


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population_millions: float = Field(ge=0, le=100)
    landmarks: list[str] = Field(max_length=3)


def test_the_openai_clients_typed_parse(client: openai.OpenAI) -> None:
    r = client.chat.completions.parse(
        model="default",
        messages=user("Describe the city of Paris."),  # type: ignore[arg-type]
        response_format=City,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    city = choice.message.parsed
    assert isinstance(city, City) and city.name and len(city.landmarks) <= 3, city


def test_create_and_stream_with_a_schema(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": "default",
        "messages": user("Describe a person named Bob who is 40."),
        "response_format": schema_format("person", PERSON),
        "max_tokens": 64,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "stop"
    valid(whole.message.content or "", PERSON)
    parts, reasons = [], []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert reasons[-1] == "stop" and len(parts) > 3
    valid("".join(parts), PERSON)
    assert "".join(parts) == whole.message.content


def test_every_choice_follows_the_schema(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="default",
        messages=user("Invent a person."),  # type: ignore[arg-type]
        response_format=schema_format("person", PERSON),  # type: ignore[arg-type]
        max_tokens=64,
        temperature=1.0,
        n=4,
        seed=11,
    )
    assert len(r.choices) == 4
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        valid(choice.message.content or "", PERSON)


def test_logprobs_are_of_the_raw_distribution(client: openai.OpenAI) -> None:
    """A regex that forces tokens the model would never pick: their log-probs stay what the
    model gave them, not 0 (the mask does not renormalise what is reported)."""
    choice = client.chat.completions.create(
        model="default",
        messages=user("What is the capital of France?"),  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        logprobs=True,
        extra_body={"regex": "zqzqzq"},
    ).choices[0]
    assert choice.message.content == "zqzqzq" and choice.logprobs is not None
    lps = [t.logprob for t in choice.logprobs.content or []]
    assert lps and min(lps) < -5, lps


# ---- bad input ---------------------------------------------------------------------------------

BAD = [
    ("/v1/chat/completions", {"messages": user("Hi"), "regex": "([a-z"}, "regex", "Unclosed"),
    ("/v1/completions", {"prompt": "Hi", "ebnf": 'root ::= "a" | foo'}, "ebnf", "foo"),
    ("/v1/completions", {"prompt": "Hi", "regex": ""}, "regex", "non-empty"),
    ("/generate", {"text": "Hi", "sampling_params": {"json_schema": "{oops"}}, "json_schema",
     "not valid JSON"),
    ("/generate", {"text": "Hi", "sampling_params": {"json_schema": {"type": "objectx"}}},
     "json_schema", "not a valid JSON Schema"),
    ("/v1/chat/completions", {"messages": user("Hi"), "regex": "a", "ebnf": 'root ::= "a"'},
     "ebnf", "at most one constraint"),
    ("/v1/chat/completions", {"messages": user("Hi"), "logit_bias": {"49152": 1}}, "logit_bias",
     "not in the vocabulary [0, 49152)"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"5": -101}}, "logit_bias",
     "must be in [-100, 100]"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"five": 1}}, "logit_bias",
     "not a token id"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param", "why"), BAD, ids=[b[3] for b in BAD])
def test_bad_grammars_and_biases_get_a_400_and_the_server_keeps_serving(
    http: httpx.Client, path: str, body: dict[str, Any], param: str, why: str
) -> None:
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(f"{param}: "), err
    assert why in err["message"], err
    ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "regex": "[a-z]+"})
    assert ok.status_code == 200, ok.text


def test_the_openai_client_sees_a_bad_schema(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="default",
            messages=user("Hi"),  # type: ignore[arg-type]
            response_format=schema_format("x", {"type": "object", "allOf": []}),  # type: ignore[arg-type]
            stream=True,  # refused before the stream starts
        )
    assert e.value.body["param"] == SCHEMA_FIELD  # type: ignore[index]


def test_bad_grammars_leave_the_requests_beside_them_alone(server: Server) -> None:
    """Good and bad constrained requests and plain ones, all at once: each bad one gets its
    400, every other one its answer."""
    bad = {"messages": user("Hi"), "max_tokens": 8, "regex": "(unclosed"}
    good = {
        "messages": user("Describe Ann, 31."),
        "max_tokens": 64,
        "temperature": 0,
        "response_format": schema_format("person", PERSON),
    }
    plain = {"messages": user("Say hi."), "max_tokens": 8}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT_S) as c:
            bodies = [bad, good, plain] * 4
            return await asyncio.gather(*(c.post("/v1/chat/completions", json=b) for b in bodies))

    answers = asyncio.run(run())
    for i, r in enumerate(answers):
        if i % 3 == 0:
            assert r.status_code == 400 and r.json()["error"]["param"] == "regex", r.text
            continue
        assert r.status_code == 200, r.text
        if i % 3 == 1:
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "stop"
            valid(choice["message"]["content"], PERSON)


# ---- logit_bias --------------------------------------------------------------------------------


def test_logit_bias_forbids_and_forces_tokens(
    client: openai.OpenAI, http: httpx.Client, tokenizer: Any
) -> None:
    prompt = "The capital of France is"

    def generate(**sp: Any) -> list[int]:
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0, **sp}}
        return list(http.post("/generate", json=body).json()["output_ids"])

    free = generate()
    banned = generate(logit_bias={str(free[0]): -100})
    assert banned[0] != free[0] and free[0] not in banned, (free, banned)
    forced = tokenizer(" banana", add_special_tokens=False)["input_ids"][-1]
    out = client.completions.create(
        model="default",
        prompt=prompt,
        max_tokens=6,
        temperature=0.8,
        logit_bias={str(forced): 100},
    ).choices[0]
    assert out.text == tokenizer.decode([forced] * 6), out
    assert generate() == free  # nothing stays behind


# ---- metrics -----------------------------------------------------------------------------------


def test_metrics_count_constrained_requests_compiles_and_cache_hits(http: httpx.Client) -> None:
    before = wait_idle(http)
    body = {"prompt": "Hi", "max_tokens": 4, "regex": f"metrics{time.time_ns()}"}
    for _ in range(2):  # the same grammar twice: compiled once, then from the cache
        assert http.post("/v1/completions", json=body).status_code == 200
    after = wait_idle(http)
    assert_pool_clean(after)

    def grew(name: str) -> float:
        return after[name] - before[name]

    assert grew("minisgl_constrained_requests") == 2
    assert grew("minisgl_grammar_compiles") == 1
    assert grew("minisgl_grammar_cache_hits") == 1
    assert grew("minisgl_grammar_compile_seconds") > 0
