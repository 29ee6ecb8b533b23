"""What OpenAI clients send and expect beyond plain text, through one real server process (the
real SmolLM2 model with a Hermes-style tools template, `--chat-template`) and the real `openai`
client: the SDK's habits (`model_dump()` of an answer sent back, `developer`, fields that do not
change the answer), model retrieval, request checks, completions logprobs, tool calls (forced by
a grammar, or declined) over two turns, the reasoning split, and the Responses API."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from serving_helpers import Server, metrics, running_server

import minisgl
from minisgl.weights import load_model_config, resolve_source

pytestmark = pytest.mark.slow  # a server of its own: about a minute to start

TEMPLATE = Path(__file__).with_name("hermes_tools.jinja")
VOCAB = 49152  # SmolLM2's
TIMEOUT_S = 600
HELLO = [{"role": "user", "content": "Say hello."}]
SERVED = ("smol", "org/smol-v2")  # --served-model-name, several


@pytest.fixture(scope="module", params=[1, 2], ids=["1-api", "2-apis"])
def server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Server]:
    logs = tmp_path_factory.mktemp("logs")
    flags = ["--chat-template", str(TEMPLATE), "--reasoning-parser", "qwen3"]
    flags += ["--served-model-name", *SERVED, "--api-server-count", str(request.param)]
    with running_server(logs, *flags) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.openai(timeout=TIMEOUT_S)  # type: ignore[return-value]


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with server.http(timeout=TIMEOUT_S) as c:
        yield c


def chat(client: openai.OpenAI, messages: list[Any], **kw: Any) -> Any:
    kw.setdefault("max_tokens", 4)
    return client.chat.completions.create(model="default", messages=messages, temperature=0, **kw)


# ---- the SDK's habits and request checks -------------------------------------------------------


def test_served_model_names_answer_and_others_are_404(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    assert [m.id for m in client.models.list().data] == list(SERVED)
    for name in SERVED:
        assert client.models.retrieve(name).id == name
        assert chat(client, HELLO, max_tokens=1).model == SERVED[0]  # "default": the first
        answer = client.chat.completions.create(model=name, messages=HELLO, max_tokens=1)
        assert answer.model == name
    assert http.get("/v1/models/default").json()["id"] == SERVED[0]
    for call in (
        lambda: client.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=1),
        lambda: client.completions.create(model="gpt-4o", prompt="Hi", max_tokens=1),
        lambda: client.responses.create(model="gpt-4o", input="Hi", max_output_tokens=1),
        lambda: client.models.retrieve("gpt-4o"),
    ):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.code == "model_not_found" and e.value.param == "model"
        assert "gpt-4o" in e.value.message and SERVED[1] in e.value.message


def test_tool_choice_without_tools_is_a_400_naming_it(client: openai.OpenAI) -> None:
    for choice in ("auto", "none", "required"):
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, HELLO, tool_choice=choice)
        assert e.value.param == "tool_choice" and e.value.code is None, choice
        assert "tools" in e.value.message


def test_a_body_without_content_type_or_as_a_form_is_read_as_json(server: Server) -> None:
    body = json.dumps({"prompt": "Hi", "max_tokens": 1}).encode()
    url, auth = f"{server.url}/v1/completions", server.headers
    r = httpx.post(url, content=body, headers=auth, timeout=TIMEOUT_S)  # no Content-Type
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    form = {**auth, "Content-Type": "application/x-www-form-urlencoded"}  # curl -d's default
    r = httpx.post(url, content=body, headers=form, timeout=TIMEOUT_S)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    text = {**auth, "Content-Type": "text/plain"}
    r = httpx.post(url, content=body, headers=text, timeout=TIMEOUT_S)
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"]


def test_models_retrieve(client: openai.OpenAI) -> None:
    served = client.models.list().data[0].id
    card = client.models.retrieve(served)
    assert card.id == served and card.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert served in e.value.message


def test_stop_token_ids_outside_the_vocabulary(client: openai.OpenAI, http: httpx.Client) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, HELLO, extra_body={"stop_token_ids": [VOCAB + 1]})
    assert str(VOCAB + 1) in e.value.message and str(VOCAB) in e.value.message
    assert e.value.body["param"] == "stop_token_ids"  # type: ignore[index]
    r = http.post("/generate", json={"text": "Hi", "sampling_params": {"stop_token_ids": [VOCAB]}})
    assert r.status_code == 400 and str(VOCAB) in r.json()["error"]["message"]
    ok = chat(client, HELLO, extra_body={"stop_token_ids": [VOCAB - 1]})
    assert ok.usage.completion_tokens >= 1


def test_stream_options_need_stream(client: openai.OpenAI) -> None:
    for stream in (False, None):
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, HELLO, stream=stream, stream_options={"include_usage": True})
        assert e.value.body["param"] == "stream_options"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(
            model="default", prompt="Hi", max_tokens=2, stream_options={"include_usage": True}
        )


def test_completion_logprobs_always_hold_the_sampled_token(client: openai.OpenAI) -> None:
    r = client.completions.create(model="default", prompt="Once upon", max_tokens=4, logprobs=0)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None and lp.tokens is not None
    assert [list(top) for top in lp.top_logprobs] == [[t] for t in lp.tokens]
    # Sampled at a high temperature, some tokens fall outside the top one: still listed.
    r = client.completions.create(
        model="default", prompt="Once upon", max_tokens=12, logprobs=1, temperature=2.0, seed=3
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None and lp.tokens is not None
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs or [], lp.top_logprobs):
        assert token in top and 1 <= len(top) <= 2 and top[token] == logprob
    assert any(len(top) == 2 for top in lp.top_logprobs)


def test_model_dump_of_an_answer_goes_back(client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "developer", "content": "Be brief."}, *HELLO]
    first = chat(client, messages)
    dumped = first.choices[0].message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call", "tool_calls"} <= set(dumped)
    messages += [dumped, {"role": "user", "content": "Again.", "name": "ann"}]
    second = chat(client, messages)
    assert second.choices[0].message.content


def test_message_shapes_clients_send(client: openai.OpenAI) -> None:
    parts = [{"type": "text", "text": "Say", "cache_control": {"type": "ephemeral"}}]
    parts += [{"type": "text", "text": " hi."}]
    messages = [
        {"role": "system", "content": "Be brief.", "name": "rules"},
        {"role": "user", "content": parts},
        {"role": "assistant", "content": "Hi.", "tool_calls": []},
        {"role": "user", "content": "Again."},
    ]
    assert chat(client, messages).choices[0].message.content


def test_fields_that_do_not_change_the_answer(client: openai.OpenAI) -> None:
    plain = chat(client, HELLO).choices[0].message.content
    r = chat(
        client,
        HELLO,
        store=False,
        metadata={"team": "a"},
        service_tier="auto",
        modalities=["text"],
        reasoning_effort="low",
        parallel_tool_calls=False,
    )
    assert r.choices[0].message.content == plain
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, HELLO, store=True)
    assert e.value.body["param"] == "store"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        chat(client, HELLO, modalities=["audio"])


# ---- tool calls --------------------------------------------------------------------------------

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 10}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Now.", "parameters": TIME},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def valid_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.fixture(scope="module")
def forced(client: openai.OpenAI) -> Any:
    """An answer with one forced call (the tests share it: a CPU takes seconds for it)."""
    return chat(
        client, ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=80
    )


def test_required_call_follows_the_schema(forced: Any) -> None:
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1 and calls[0].type == "function"
    assert calls[0].id.startswith("call_")
    valid_call(calls[0].function.name, calls[0].function.arguments)
    assert not choice.message.content


def test_parallel_required_calls_all_validate(client: openai.OpenAI) -> None:
    r = chat(client, ASK, tools=TOOLS, tool_choice="required", max_tokens=60)
    calls = r.choices[0].message.tool_calls
    assert calls, r.choices[0]  # the first call fits in the tokens; later ones may be cut off
    for c in calls:
        valid_call(c.function.name, c.function.arguments)
    assert len({c.id for c in calls}) == len(calls)


def streamed_calls(stream: Any) -> tuple[list[Any], dict[int, list[str]], list[str]]:
    """A streamed answer's call heads (first deltas), argument fragments by call index, and
    finish reasons."""
    heads: list[Any] = []
    fragments: dict[int, list[str]] = {}
    reasons = []
    for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or ():
                if tc.id is not None:  # a call's first delta: no arguments yet
                    assert tc.type == "function" and tc.function.arguments == ""
                    assert tc.index not in fragments
                    heads.append(tc)
                    fragments[tc.index] = []
                else:
                    assert tc.function.name is None and tc.function.arguments
                    fragments[tc.index].append(tc.function.arguments)
            if c.finish_reason:
                reasons.append(c.finish_reason)
    return heads, fragments, reasons


def test_named_call_streams_as_openai_does(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    stream = chat(client, ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                  max_tokens=80, stream=True)  # fmt: skip
    heads, fragments, reasons = streamed_calls(stream)
    assert [(h.index, h.function.name) for h in heads] == [(0, "get_time")]
    valid_call("get_time", "".join(fragments[0]))
    assert reasons == ["tool_calls"]


def test_streamed_arguments_arrive_in_pieces_that_join_to_the_answer(
    client: openai.OpenAI, forced: Any
) -> None:
    """The same request as `forced`, streamed: the arguments come in fragments as the model
    writes them, and joined they are the non-streamed answer's arguments."""
    stream = chat(client, ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                  max_tokens=80, stream=True)  # fmt: skip
    heads, fragments, reasons = streamed_calls(stream)
    [call] = forced.choices[0].message.tool_calls
    assert [(h.index, h.function.name) for h in heads] == [(0, call.function.name)]
    assert len(fragments[0]) > 1, fragments
    assert "".join(fragments[0]) == call.function.arguments
    assert reasons == ["tool_calls"]


def test_none_answers_in_words_and_a_second_turn_is_answered(
    client: openai.OpenAI, forced: Any
) -> None:
    r = chat(client, ASK, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    answer = forced.choices[0].message
    assert answer.tool_calls
    messages = [*ASK, answer.model_dump()]
    messages.append({"role": "tool", "tool_call_id": answer.tool_calls[0].id, "content": "18 C"})
    second = chat(client, messages, tools=TOOLS, max_tokens=8)
    assert second.choices[0].message.content


def test_tool_choice_mistakes_are_400s(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_mood"}}
    with pytest.raises(openai.BadRequestError, match="get_mood"):
        chat(client, ASK, tools=TOOLS, tool_choice=named)
    with pytest.raises(openai.BadRequestError) as e:
        chat(
            client,
            ASK,
            tools=TOOLS,
            tool_choice="required",
            response_format={"type": "json_object"},
        )
    assert e.value.body["param"] == "tool_choice"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):  # a role tool message needs its call's id
        chat(client, [*ASK, {"role": "tool", "content": "18 C"}])
    unenforceable = {"type": "object", "not": {"required": ["x"]}}
    bad = [{"type": "function", "function": {"name": "f", "parameters": unenforceable}}]
    with pytest.raises(openai.BadRequestError, match="function 'f'") as e:
        chat(client, ASK, tools=bad, tool_choice="required")
    assert e.value.body["param"] == "tools"  # type: ignore[index]


# ---- reasoning ---------------------------------------------------------------------------------

# SmolLM2 does not think; a regex makes it write a thinking part for the qwen3 parser to split.
THINK = r"<think>[a-z ]{3,10}</think>\n[A-Za-z ]{3,10}"


def test_reasoning_is_split_off(client: openai.OpenAI) -> None:
    r = chat(client, HELLO, max_tokens=40, extra_body={"regex": THINK})
    message = r.choices[0].message
    reasoning = message.model_extra["reasoning_content"]  # type: ignore[index]
    assert reasoning and "<think>" not in message.content and "</think>" not in message.content
    stream = chat(client, HELLO, max_tokens=40, stream=True, extra_body={"regex": THINK})
    parts = {"reasoning_content": "", "content": ""}
    for chunk in stream:
        for c in chunk.choices:
            for key in parts:
                parts[key] += (
                    (c.delta.model_extra or {}).get(key) or getattr(c.delta, key, None) or ""
                )
    assert parts == {"reasoning_content": reasoning, "content": message.content}


def test_thinking_off_leaves_the_output_whole(client: openai.OpenAI) -> None:
    off = {"regex": THINK, "chat_template_kwargs": {"enable_thinking": False}}
    r = chat(client, HELLO, max_tokens=40, extra_body=off)
    assert r.choices[0].message.content.startswith("<think>")
    assert r.choices[0].message.model_extra["reasoning_content"] is None  # type: ignore[index]


# ---- the Responses API -------------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
RESPONSE_TOOLS: list[Any] = [
    {"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
    for t in TOOLS
]


def test_responses_text(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model="default",
        input="Say hello.",
        instructions="Be brief.",
        max_output_tokens=6,
        temperature=0,
    )
    assert r.object == "response" and r.output_text
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]
    assert r.usage is not None and r.usage.output_tokens == 6
    events = list(
        client.responses.create(
            model="default", input="Say hello.", instructions="Be brief.", max_output_tokens=6,
            temperature=0, stream=True,
        )
    )  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text  # type: ignore[union-attr]


def test_responses_json_schema(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = client.responses.create(
        model="default",
        input="A person as JSON.",
        text={"format": fmt},
        max_output_tokens=60,  # type: ignore[typeddict-item]
        temperature=0,
    )
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), PERSON)
    events = list(
        client.responses.create(
            model="default", input="A person as JSON.", text={"format": fmt}, max_output_tokens=60,  # type: ignore[typeddict-item]
            temperature=0, stream=True,
        )
    )  # fmt: skip
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text and events[-1].type == "response.completed"


def test_responses_function_calls_and_their_outputs(client: openai.OpenAI) -> None:
    choice = {"type": "function", "name": "get_weather"}
    r = client.responses.create(
        model="default", input="Weather in Paris?", tools=RESPONSE_TOOLS, tool_choice=choice,  # type: ignore[arg-type]
        parallel_tool_calls=False, max_output_tokens=80, temperature=0,
    )  # fmt: skip
    [call] = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather"
    valid_call(call.name, call.arguments)
    events = list(
        client.responses.create(
            model="default", input="Weather in Paris?", tools=RESPONSE_TOOLS, tool_choice=choice,  # type: ignore[arg-type]
            parallel_tool_calls=False, max_output_tokens=80, temperature=0, stream=True,
        )
    )  # fmt: skip
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == call.arguments
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments and done.name == "get_weather"
    assert events[-1].type == "response.completed"
    # The second turn: the call and its output sent back as items.
    items = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump()]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "18 C"})
    second = client.responses.create(
        model="default",
        input=items,
        tools=RESPONSE_TOOLS,
        max_output_tokens=6,
        temperature=0,  # type: ignore[arg-type]
    )
    assert second.output_text


def test_responses_store_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="default", input="Hi", store=True, max_output_tokens=2)
    assert e.value.body["param"] == "store"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="default", input="Hi", previous_response_id="resp_1")


# ---- /tokenize, /detokenize, /version and the start-up summary ----------------------------------


def test_tokenize_detokenize_round_trip_equals_the_tokenizer(
    http: httpx.Client, tokenizer: Any
) -> None:
    text = "Hello, world! Ünïcödé and numbers 12345."
    r = http.post("/tokenize", json={"model": SERVED[1], "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    own = tokenizer.encode(text)
    assert body["tokens"] == own and body["count"] == len(own)
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(own)
    assert body["max_model_len"] == http.get("/v1/models").json()["data"][0]["max_model_len"]
    back = http.post("/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": tokenizer.decode(own)}
    chat_ids = http.post("/tokenize", json={"messages": HELLO}).json()["tokens"]
    tokenizer_with_template = dict(chat_template=TEMPLATE.read_text())
    rendered = tokenizer.apply_chat_template(
        HELLO, tokenize=False, add_generation_prompt=True, **tokenizer_with_template
    )
    assert chat_ids == tokenizer.encode(rendered, add_special_tokens=False)
    for path, bad, param in (
        ("/tokenize", {"prompt": "a", "messages": HELLO}, "prompt"),
        ("/detokenize", {"tokens": [VOCAB]}, "tokens"),
        ("/tokenize", {"model": "gpt-4o", "prompt": "a"}, "model"),
    ):
        r = http.post(path, json=bad)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


def test_version_route_and_flag(http: httpx.Client) -> None:
    assert http.get("/version").json() == {"version": minisgl.__version__}
    out = subprocess.run(
        [sys.executable, "-m", "minisgl", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"minisgl {minisgl.__version__}"


def test_the_start_up_summary_is_one_block_with_the_engines_numbers(
    server: Server, http: httpx.Client
) -> None:
    log = server.log_text()
    assert "EngineInfo(" not in log and log.count("  KV pool ") == 1
    m = re.search(
        r"KV pool +(\d+) pages x (\d+) tokens = (\d+) tokens, ([\d.]+) GiB \((\w+)\)", log
    )
    assert m is not None, log[-3000:]
    pages, page_size, tokens, gib, kv_dtype = int(m[1]), int(m[2]), int(m[3]), m[4], m[5]
    kv = metrics(http)
    states = ("free", "held", "protected", "evictable")
    assert (
        pages == kv["minisgl_kv_pages[total]"] == sum(kv[f"minisgl_kv_pages[{s}]"] for s in states)
    )
    assert tokens == pages * page_size and kv_dtype == "float32"  # the CPU's default
    cfg = load_model_config(resolve_source(None))
    kv_bytes = 2 * cfg.num_layers * tokens * cfg.num_kv_heads * cfg.head_dim * 4
    assert gib == f"{kv_bytes / 2**30:.2f}"
    for line in ("dtype       float32 on cpu", "weights     ", "CUDA graphs none", "ready in    "):
        assert line in log, line
