"""What OpenAI clients send and expect beyond plain text, through one real server process (the
real SmolLM2 model with a Hermes-style tools template, `--chat-template`) and the real `openai`
client: the SDK's habits (`model_dump()` of an answer sent back, `developer`, fields that do not
change the answer), model retrieval, request checks, completions logprobs, tool calls (forced by
a grammar, or declined) over two turns, the reasoning split, and the Responses API."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from serving_helpers import Server, start_server

pytestmark = pytest.mark.slow  # a server of its own: about a minute to start

TEMPLATE = Path(__file__).with_name("hermes_tools.jinja")
VOCAB = 49152  # SmolLM2's
TIMEOUT_S = 600
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("logs"),
        "--chat-template",
        str(TEMPLATE),
        "--reasoning-parser",
        "qwen3",
    )
    try:
        server.wait_ready()
        yield server
    finally:
        left = server.terminate()
    assert not left, f"SIGTERM left processes behind: {left}"


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.openai(timeout=TIMEOUT_S)  # type: ignore[return-value]


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with server.http(timeout=TIMEOUT_S) as c:
        yield c


def chat(client: openai.OpenAI, messages: list[Any], **kw: Any) -> Any:
    kw.setdefault("max_tokens", 4)
    return client.chat.completions.create(model="m", messages=messages, temperature=0, **kw)


# ---- the SDK's habits and request checks -------------------------------------------------------


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
            model="m", prompt="Hi", max_tokens=2, stream_options={"include_usage": True}
        )


def test_completion_logprobs_always_hold_the_sampled_token(client: openai.OpenAI) -> None:
    r = client.completions.create(model="m", prompt="Once upon", max_tokens=4, logprobs=0)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None and lp.tokens is not None
    assert [list(top) for top in lp.top_logprobs] == [[t] for t in lp.tokens]
    # Sampled at a high temperature, some tokens fall outside the top one: still listed.
    r = client.completions.create(
        model="m", prompt="Once upon", max_tokens=12, logprobs=1, temperature=2.0, seed=3
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
