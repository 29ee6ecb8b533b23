"""Both front doors answer a chat with tools alike: the offline `LLM.chat` and a real server
process, each on the real SmolLM2 with the same Hermes-style tools template and the qwen3
reasoning parser, give the same assistant message (content, reasoning, parsed calls) and finish
reason for forced, named and withheld calls, a call's answer over two turns, and a thinking
part split off. Call ids are drawn at random on each side, so they are compared by shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from serving_helpers import running_server
from test_openai_compat import ASK, SCHEMAS, THINK, TOOLS

from minisgl import LLM, SamplingParams
from minisgl.core import InvalidRequestError

pytestmark = pytest.mark.slow  # a server of its own: about a minute to start

TEMPLATE = Path(__file__).with_name("hermes_tools.jinja")


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    logs = tmp_path_factory.mktemp("logs")
    args = ("--chat-template", str(TEMPLATE), "--reasoning-parser", "qwen3")
    with running_server(logs, *args) as server, server.http(timeout=600) as client:
        yield client


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(chat_template=str(TEMPLATE), reasoning_parser="qwen3")


def both(http: httpx.Client, llm: LLM, messages: list[Any], max_tokens: int, **kw: Any) -> Any:
    """The server's and the offline choice (message and finish reason), ids blanked."""
    regex = kw.pop("regex", None)
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **kw}
    r = http.post("/v1/chat/completions", json={**body, **({"regex": regex} if regex else {})})
    assert r.status_code == 200, r.text
    online = r.json()["choices"][0]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, regex=regex)
    offline = llm.chat(messages, params, use_tqdm=False, **kw)[0]
    got = []
    for message, reason in (
        (online["message"], online["finish_reason"]),
        (offline["message"], offline["finish_reason"]),
    ):
        calls = message.get("tool_calls") or []
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
        got.append(({**message, "tool_calls": [c["function"] for c in calls]}, reason))
    assert got[0] == got[1]
    return got[1]


def test_forced_and_named_calls_are_parsed_alike(http: httpx.Client, llm: LLM) -> None:
    message, reason = both(
        http, llm, ASK, 80, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
    )
    assert reason == "tool_calls" and message["content"] is None
    [call] = message["tool_calls"]
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    named = {"type": "function", "function": {"name": "get_time"}}
    message, reason = both(http, llm, ASK, 80, tools=TOOLS, tool_choice=named)
    assert reason == "tool_calls" and {c["name"] for c in message["tool_calls"]} == {"get_time"}
    assert "reasoning_content" in message  # the reasoning parser is on: null here


def test_a_call_answered_over_two_turns(http: httpx.Client, llm: LLM) -> None:
    first = llm.chat(ASK, SamplingParams(max_tokens=80, temperature=0), use_tqdm=False,
                     tools=TOOLS, tool_choice="required", parallel_tool_calls=False)[0]  # fmt: skip
    [call] = first["message"]["tool_calls"]
    messages = [
        *ASK,
        first["message"],
        {"role": "tool", "tool_call_id": call["id"], "content": "18 C"},
    ]
    message, _ = both(http, llm, messages, 8, tools=TOOLS)
    assert message["content"]
    message, _ = both(http, llm, ASK, 8, tools=TOOLS, tool_choice="none")
    assert message["content"] and not message["tool_calls"]


def test_thinking_is_split_off_alike(http: httpx.Client, llm: LLM) -> None:
    message, _ = both(http, llm, ASK, 40, regex=THINK)
    assert message["reasoning_content"] and "</think>" not in message["content"]
    off = {"enable_thinking": False}
    message, _ = both(http, llm, ASK, 40, regex=THINK, chat_template_kwargs=off)
    assert message["reasoning_content"] is None and message["content"].startswith("<think>")


def test_offline_tool_mistakes_name_the_field(llm: LLM) -> None:
    params = SamplingParams(max_tokens=4)
    with pytest.raises(InvalidRequestError, match="tool_choice: no tool is named 'nope'"):
        llm.chat(ASK, params, tools=TOOLS, tool_choice={"function": {"name": "nope"}})
    with pytest.raises(InvalidRequestError, match="tool_choice: a forced call cannot also"):
        llm.chat(ASK, SamplingParams(regex="a+"), tools=TOOLS, tool_choice="required")
    with pytest.raises(InvalidRequestError, match="tools: each is"):
        llm.chat(ASK, params, tools=[{"name": "f"}], tool_choice="required")


# ---- the offline API's conveniences ------------------------------------------------------------


def test_a_string_is_one_prompt_and_params_may_be_a_dict(llm: LLM) -> None:
    params = {"max_tokens": 3, "temperature": 0}
    one = llm.generate("Hello", params, use_tqdm=False)
    assert len(one) == 1 and one[0]["completion_tokens"] == 3
    assert one[0]["prompt_tokens"] == len(llm.tokenizer("Hello")["input_ids"])
    listed = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert one[0]["token_ids"] == listed[0]["token_ids"]
    ids = llm.generate(listed[0]["token_ids"], params, use_tqdm=False)  # one id list: one prompt
    assert len(ids) == 1 and ids[0]["prompt_tokens"] == 3
    with pytest.raises(ValueError, match="unknown fields \\['max_new_tokens'\\]"):
        llm.generate("Hello", {"max_new_tokens": 3}, use_tqdm=False)


def test_the_start_up_summary_has_the_engines_numbers(llm: LLM) -> None:
    engine, summary = llm.engine, llm.startup
    pool = engine.pool
    tokens = engine.num_pages * engine.page_size
    k = pool.k(0)[:tokens]  # one layer's K of the pages handed out
    assert summary.kv_tokens == tokens and summary.kv_pages == engine.num_pages
    assert summary.kv_bytes == 2 * pool.num_layers * k.numel() * k.element_size()
    params = {id(p): p for p in (*engine.model.parameters(), *engine.model.buffers())}
    assert summary.weights_bytes == sum(p.nbytes for p in params.values())
    text = summary.text()
    assert f"{engine.num_pages} pages x {engine.page_size} tokens = {tokens} tokens" in text
    assert f"{summary.kv_bytes / 2**30:.2f} GiB (float32)" in text
    assert summary.dtype == "float32" and "on cpu" in text and summary.graphs == 0
