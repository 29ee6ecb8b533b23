"""The HTTP API of a real server process on 127.0.0.1 (default SmolLM2 model, API key on),
driven with the `openai` client and raw HTTP, against the offline LLM and transformers."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from serving_helpers import Server, metrics, start_server

from minisgl import LLM, SamplingParams
from minisgl.weights import default_model_path

# Each module starts a real server (about 30 s of model loading on a 2-core CPU).
pytestmark = pytest.mark.slow

API_KEY = "test-key"
COUNT = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
EOS = 2  # <|im_end|>
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]


@dataclass
class Stack:
    server: Server
    llm: Any
    hf: Any


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # The references load while the server starts (both take tens of seconds).
    server = start_server(tmp_path_factory.mktemp("logs"), api_key=API_KEY, key_from="file")
    try:
        from transformers import AutoModelForCausalLM

        llm = LLM()
        path = default_model_path()
        hf = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
        server.wait_ready()
        yield Stack(server, llm, hf)
    finally:
        left = server.terminate()
    assert not left, f"SIGTERM left processes behind: {left}"


@pytest.fixture(scope="module")
def server(stack: Stack) -> Server:
    return stack.server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.openai()  # type: ignore[return-value]


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with server.http() as c:
        yield c


@pytest.mark.skipif(not Path("/proc/self/comm").exists(), reason="needs Linux /proc")
def test_worker_processes_are_named(server: Server) -> None:
    """`ps` / `top` tell the workers apart: each sets its OS-level process name."""
    workers = (("scheduler", "sched"), ("tokenizer", "tok"), ("detokenizer", "detok"))
    for worker, name in (*workers, ("api0", "api0")):
        comm = Path(f"/proc/{server.worker_pid(worker)}/comm").read_text().strip()
        assert comm == f"minisgl:{name}"


def chat(client: openai.OpenAI, messages: Any = COUNT, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 16)
    return client.chat.completions.create(model="default", messages=messages, **kw)


# ---- basics ----------------------------------------------------------------------------------


def test_health_is_open_and_the_rest_needs_the_key(server: Server) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    for method, path in [
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("GET", "/openapi.json"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/generate"),
    ]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            r = httpx.request(method, f"{server.url}{path}", headers=headers, json={})
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.code == "invalid_api_key"  # a string, as OpenAI sends it


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct.Q4_1"]


# ---- every field changes the answer as it should ---------------------------------------------


def test_greedy_chat_equals_the_offline_llm(client: openai.OpenAI, stack: Stack) -> None:
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    expected = stack.llm.chat(convs, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    for conv, exp in zip(convs, expected, strict=True):
        r = chat(client, conv, max_tokens=16, temperature=0)
        assert r.choices[0].message.content == exp["text"]
        assert r.choices[0].finish_reason == exp["finish_reason"]
        assert r.usage.completion_tokens == exp["completion_tokens"]
        assert r.usage.prompt_tokens == exp["prompt_tokens"]


def test_greedy_ids_equal_the_offline_llm(http: httpx.Client, stack: Stack) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3,"]
    expected = stack.llm.generate(
        prompts, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False
    )
    for prompt, exp in zip(prompts, expected, strict=True):
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
        r = http.post("/generate", json=body).json()
        assert r["output_ids"] == exp["token_ids"]
        assert r["text"] == exp["text"]


def test_logprobs_are_the_log_softmax_of_the_models_logits(
    http: httpx.Client, stack: Stack
) -> None:
    prompt = stack.llm.apply_chat_template(FRANCE)
    sp = {"max_new_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 5}
    r = http.post("/generate", json={"input_ids": prompt, "sampling_params": sp}).json()
    out, lps = r["output_ids"], r["meta_info"]["output_token_logprobs"]
    with torch.no_grad():
        logits = stack.hf(torch.tensor([prompt + out])).logits[0].float()
    ref = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # [len(out), vocab]
    for j, (tok, lp) in enumerate(zip(out, lps, strict=True)):
        assert lp["token_id"] == tok
        assert abs(lp["logprob"] - ref[j, tok].item()) < 1e-4
        top_vals, top_ids = ref[j].topk(5)
        got = [t["logprob"] for t in lp["top_logprobs"]]
        assert torch.allclose(torch.tensor(got), top_vals, atol=1e-4)
        assert [t["token"] for t in lp["top_logprobs"]] == [
            stack.llm.tokenizer.decode([i]) for i in top_ids.tolist()
        ]


def test_chat_logprobs_match_the_native_ones(
    client: openai.OpenAI, http: httpx.Client, stack: Stack
) -> None:
    r = chat(client, FRANCE, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    prompt = stack.llm.apply_chat_template(FRANCE)
    sp = {"max_new_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    native = http.post("/generate", json={"input_ids": prompt, "sampling_params": sp}).json()
    ref = native["meta_info"]["output_token_logprobs"]
    assert [c.token for c in content] == [t["token"] for t in ref[: len(content)]]
    assert all(abs(c.logprob - t["logprob"]) < 1e-5 for c, t in zip(content, ref, strict=False))
    assert all(len(c.top_logprobs) == 3 for c in content)
    assert content[0].bytes == list(content[0].token.encode())
    assert chat(client, FRANCE, max_tokens=2).choices[0].logprobs is None


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model="default", prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    assert all(
        max(t.values()) == pytest.approx(v)
        for t, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )  # greedy picks the top


def test_n_gives_n_choices_and_counts_the_prompt_once(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"max_tokens": 6, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    one = chat(client, seed=1, **kw)
    r = chat(client, n=3, seed=1, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.usage.completion_tokens == 3 * 6
    assert r.choices[0].message.content == one.choices[0].message.content  # seed + 0
    assert len({c.message.content for c in r.choices}) > 1  # three different samples


def test_seeded_sampling_repeats(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"max_tokens": 8, "temperature": 1.0, "top_p": 0.95}
    a = chat(client, seed=123, **kw).choices[0].message.content
    assert chat(client, seed=123, **kw).choices[0].message.content == a
    assert chat(client, seed=124, **kw).choices[0].message.content != a
    # Choice i of a seeded request samples with seed + i.
    two = chat(client, seed=122, n=2, **kw)
    assert two.choices[1].message.content == a


def test_temperature_zero_and_top_k_one_are_greedy(client: openai.OpenAI, counting: str) -> None:
    top1 = chat(client, temperature=1.5, max_tokens=24, extra_body={"top_k": 1})
    assert top1.choices[0].message.content == counting


@pytest.fixture(scope="module")
def counting(client: openai.OpenAI) -> str:
    """The greedy answer to COUNT: "1, 2, 3, ..." (each number is three tokens)."""
    text = str(chat(client, temperature=0, max_tokens=24).choices[0].message.content)
    assert text.startswith("1, 2, 3, 4, 5, 6, 7")
    return text


def test_stop_strings_cut_the_answer(client: openai.OpenAI, counting: str) -> None:
    for stop in ["5", [", 5", "xyz"], ", 6, 7"]:  # the last spans several tokens
        r = chat(client, temperature=0, max_tokens=24, stop=stop)
        first = stop if isinstance(stop, str) else stop[0]
        assert r.choices[0].message.content == counting[: counting.index(first)]
        assert r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens < 24


def test_a_stop_string_stops_the_engine(http: httpx.Client, client: openai.OpenAI) -> None:
    before = wait_idle(http)["minisgl_engine_generated_tokens"]
    r = chat(client, temperature=0, max_tokens=500, stop=", 4", extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    sampled = wait_idle(http)["minisgl_engine_generated_tokens"] - before
    # The abort reaches the scheduler a step or two after the match, not 500 tokens later.
    assert r.usage.completion_tokens <= sampled <= r.usage.completion_tokens + 4


def test_stop_strings_while_streaming(client: openai.OpenAI, counting: str) -> None:
    full = counting
    stream = chat(client, temperature=0, max_tokens=24, stop=", 6", stream=True)
    parts, reasons = [], []
    for chunk in stream:
        parts.append(chunk.choices[0].delta.content or "")
        reasons.append(chunk.choices[0].finish_reason)
    assert "".join(parts) == full[: full.index(", 6")]
    assert reasons[-1] == "stop" and all(r is None for r in reasons[:-1])


def test_stop_token_ids_and_ignore_eos(client: openai.OpenAI, stack: Stack) -> None:
    comma = stack.llm.tokenizer.convert_tokens_to_ids(",")
    r = chat(client, temperature=0, max_tokens=8, extra_body={"stop_token_ids": [comma]})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == "1"
    short = chat(client, FRANCE, temperature=0, max_tokens=12)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 12
    r = chat(client, FRANCE, temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12


def test_max_tokens_and_max_completion_tokens(client: openai.OpenAI) -> None:
    r = chat(client, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    r = chat(client, max_tokens=None, max_completion_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_penalties_change_the_answer(client: openai.OpenAI) -> None:
    def complete(**kw: Any) -> str:
        r = client.completions.create(
            model="default", prompt="hello hello hello hello", max_tokens=10, temperature=0, **kw
        )
        return str(r.choices[0].text)

    base = complete()
    for kw in [
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 2.0}},
    ]:
        assert complete(**kw) != base, kw


def test_system_messages_and_text_parts(client: openai.OpenAI) -> None:
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the capital "},
                {"type": "text", "text": "of France?"},
            ],
        }
    ]
    assert (
        chat(client, parts, temperature=0, max_tokens=8).choices[0].message.content
        == chat(client, FRANCE, temperature=0, max_tokens=8).choices[0].message.content
    )
    # SmolLM2's template adds its own system prompt unless the conversation brings one.
    sys_msg = [{"role": "system", "content": "Be brief."}, *FRANCE]
    assert (
        chat(client, sys_msg, max_tokens=1).usage.prompt_tokens
        != chat(client, FRANCE, max_tokens=1).usage.prompt_tokens
    )


def test_completions_with_several_prompts(client: openai.OpenAI, stack: Stack) -> None:
    ids = stack.llm.tokenizer("The capital of France is")["input_ids"]
    r = client.completions.create(
        model="default",
        prompt=["The capital of France is", "1, 2, 3,"],
        max_tokens=5,
        temperature=0,
        n=2,
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text  # greedy
    by_ids = client.completions.create(model="default", prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    assert r.usage.prompt_tokens == len(ids) + len(stack.llm.tokenizer("1, 2, 3,")["input_ids"])
    assert r.usage.completion_tokens == 20


def test_streaming_chat_chunks_and_usage(client: openai.OpenAI, http: httpx.Client) -> None:
    expected = chat(client, temperature=0, max_tokens=10)
    stream = chat(
        client, temperature=0, max_tokens=10, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == expected.usage.prompt_tokens
    body = {"messages": COUNT, "max_tokens": 3, "stream": True}
    raw = http.post("/v1/chat/completions", json=body).text
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_streaming_completions(client: openai.OpenAI) -> None:
    expected = client.completions.create(
        model="default", prompt="Once upon a time", max_tokens=8, temperature=0
    )
    chunks = list(
        client.completions.create(
            model="default",
            prompt="Once upon a time",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8


def test_cached_tokens_are_reported(client: openai.OpenAI) -> None:
    long_conv = [{"role": "user", "content": "Remember this: " + "apple banana cherry " * 30}]
    chat(client, long_conv, max_tokens=1)
    r = chat(client, long_conv, max_tokens=1)
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert r.usage.prompt_tokens - 2 <= cached < r.usage.prompt_tokens  # radix: all but the last


def test_native_generate(http: httpx.Client) -> None:
    r = http.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}})
    body = r.json()
    assert len(body["output_ids"]) == 4 and body["meta_info"]["finish_reason"] == "length"
    assert body["meta_info"]["completion_tokens"] == 4
    req = {
        "input_ids": [504, 3575],
        "stream": True,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0},
    }
    events = [e for e in http.post("/generate", json=req).text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    outs = [json.loads(e[6:]) for e in events[:-1]]
    assert sum(len(o["output_ids"]) for o in outs) == 3
    assert outs[-1]["meta_info"]["finish_reason"] == "length"


# ---- load, disconnects, metrics --------------------------------------------------------------


def test_64_concurrent_streams_complete_with_correct_usage(server: Server, stack: Stack) -> None:
    convs = [
        [{"role": "user", "content": f"Tell me a fact about the number {i}."}] for i in range(64)
    ]
    prompt_lens = [len(stack.llm.apply_chat_template(c)) for c in convs]

    async def one(c: openai.AsyncOpenAI, conv: Any) -> tuple[str, Any, str | None]:
        stream = await c.chat.completions.create(
            model="default",
            messages=conv,
            max_tokens=8,
            temperature=0.7,
            seed=len(conv[0]["content"]),
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage, reason = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                reason = chunk.choices[0].finish_reason or reason
            usage = chunk.usage or usage
        return text, usage, reason

    async def run() -> list[tuple[str, Any, str | None]]:
        async with server.async_openai() as c:  # type: ignore[attr-defined]
            return await asyncio.gather(*(one(c, conv) for conv in convs))

    results = asyncio.run(run())
    for (text, usage, reason), plen in zip(results, prompt_lens, strict=True):
        assert reason == "length" and text
        assert usage.completion_tokens == 8 and usage.prompt_tokens == plen
        assert usage.total_tokens == plen + 8


def wait_idle(http: httpx.Client, timeout: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = metrics(http)
        if m["minisgl_num_running_reqs"] == 0 and m["minisgl_num_waiting_reqs"] == 0:
            return m
        time.sleep(0.2)
    raise AssertionError(f"requests still running after {timeout} s: {m}")


def assert_pool_clean(m: dict[str, float]) -> None:
    pages = {
        k: m[f"minisgl_kv_pages[{k}]"] for k in ("free", "held", "protected", "evictable", "total")
    }
    assert pages["held"] == 0 and pages["protected"] == 0, pages
    assert pages["free"] + pages["evictable"] == pages["total"], pages


def test_clients_that_disconnect_free_everything(
    server: Server, http: httpx.Client, client: openai.OpenAI
) -> None:
    before = wait_idle(http)
    assert_pool_clean(before)
    body = {"messages": COUNT, "max_tokens": 2000, "ignore_eos": True, "temperature": 0.8}

    async def leave_mid_stream(c: httpx.AsyncClient, i: int) -> int:
        chunks = 0
        async with c.stream(
            "POST", "/v1/chat/completions", json={**body, "stream": True, "seed": i}
        ) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                chunks += line.startswith("data: ")
                if chunks >= 3:
                    break  # closing the response drops the connection
        return chunks

    async def leave_while_waiting(c: httpx.AsyncClient) -> None:
        with pytest.raises(httpx.ReadTimeout):
            await c.post("/v1/chat/completions", json=body, timeout=3)

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120) as c:
            await asyncio.gather(
                *(leave_mid_stream(c, i) for i in range(20)),
                *(leave_while_waiting(c) for _ in range(4)),
            )

    asyncio.run(run())
    after = wait_idle(http, timeout=30)  # 2000-token requests would run for minutes
    assert_pool_clean(after)
    assert after["minisgl_kv_pages[total]"] == before["minisgl_kv_pages[total]"]
    assert (
        after["minisgl_requests_total[abort]"] - before.get("minisgl_requests_total[abort]", 0)
        == 24
    )
    assert chat(client, max_tokens=2).usage.completion_tokens == 2  # still serving


def test_flush_cache_empties_the_prefix_cache(http: httpx.Client, client: openai.OpenAI) -> None:
    chat(client, max_tokens=2)
    assert wait_idle(http)["minisgl_kv_pages[evictable]"] > 0
    r = http.post("/flush_cache")
    assert (r.status_code, r.json()) == (200, {"status": "flushed"})
    m = metrics(http)  # the answer comes after the scheduler's stats that show it
    assert m["minisgl_kv_pages[evictable]"] == 0
    assert m["minisgl_kv_pages[free]"] == m["minisgl_kv_pages[total]"]


def test_flush_cache_is_refused_while_requests_run(http: httpx.Client) -> None:
    body = {"messages": COUNT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()  # kept: a dropped iterator would close the stream
        assert next(lines).startswith("data: ")  # the request is running
        r = http.post("/flush_cache")
        assert r.status_code == 400
        assert r.json()["error"]["message"].endswith("requests in flight: 1")
    # Closing the stream aborted the request; the flush goes through once the abort lands.
    deadline = time.monotonic() + 30
    while (r := http.post("/flush_cache")).status_code == 400:
        assert time.monotonic() < deadline, r.json()
        time.sleep(0.1)
    assert r.json() == {"status": "flushed"}
    assert_pool_clean(metrics(http))


def test_metrics(http: httpx.Client, client: openai.OpenAI) -> None:
    before = metrics(http)
    chat(client, max_tokens=5, temperature=0)
    m = metrics(http)
    assert m["minisgl_generation_tokens_total"] - before["minisgl_generation_tokens_total"] == 5
    assert m["minisgl_prompt_tokens_total"] > before["minisgl_prompt_tokens_total"]
    assert (
        m["minisgl_time_to_first_token_seconds_count"]
        > before["minisgl_time_to_first_token_seconds_count"]
    )
    assert (
        m["minisgl_inter_token_latency_seconds_count"]
        >= before["minisgl_inter_token_latency_seconds_count"] + 4
    )
    assert 0 < m["minisgl_prefix_cache_hit_rate"] < 1
    assert "minisgl_kv_cache_usage" in m and "minisgl_e2e_request_latency_seconds_count" in m


# ---- bad input -------------------------------------------------------------------------------

MSG = {"messages": FRANCE}
BAD = [
    ("chat", b'{"messages": [', "malformed JSON"),
    ("chat", b'{"model": "default"}', "missing messages"),
    ("completions", b'{"model": "default"}', "missing prompt"),
    ("chat", {"messages": "hello"}, "messages of the wrong type"),
    ("chat", {**MSG, "max_tokens": "ten"}, "max_tokens of the wrong type"),
    ("chat", {**MSG, "temperature": "hot"}, "temperature of the wrong type"),
    ("chat", {**MSG, "stop": 5}, "stop of the wrong type"),
    ("completions", {"prompt": "hello " * 9000}, "prompt longer than the context"),
    ("completions", {"prompt": [5] * 8192}, "token prompt longer than the context"),
    ("completions", {"prompt": [49152]}, "token id outside the vocabulary"),
    ("completions", {"prompt": ""}, "empty prompt"),
    ("chat", {**MSG, "max_tokens": 0}, "max_tokens < 1"),
    ("chat", {**MSG, "max_tokens": 9000}, "max_tokens beyond the context"),
    ("chat", {**MSG, "max_tokens": 2**80}, "max_tokens beyond any integer"),
    ("chat", {**MSG, "n": 0}, "n too small"),
    ("chat", {**MSG, "n": 17}, "n too large"),
    ("chat", {**MSG, "temperature": -0.5}, "negative temperature"),
    ("chat", {**MSG, "top_p": 0}, "top_p of 0"),
    ("chat", {**MSG, "top_p": 1.5}, "top_p above 1"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "unknown role"),
    ("completions", b'{"prompt": "caf\xe9 \xff"}', "invalid UTF-8 bytes"),
    ("completions", b'{"prompt": "\\ud800"}', "a lone surrogate"),
    ("chat", {**MSG, "tool_choice": "required"}, "a forced tool call without tools"),
    ("chat", {**MSG, "stream_options": {"include_usage": True}}, "stream_options without stream"),
    ("chat", {**MSG, "response_format": {"type": "json_schema"}}, "response_format without schema"),
    ("chat", {**MSG, "regex": "(unclosed"}, "a regex that does not compile"),
    ("chat", {**MSG, "top_logprobs": 2}, "top_logprobs without logprobs"),
    ("chat", {**MSG, "frobnicate": 1}, "an unknown field"),
    ("completions", {"prompt": "hi", "echo": True}, "echo"),
    ("generate", {"text": "a", "input_ids": [1]}, "two prompts"),
]
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "generate": "/generate"}


@pytest.mark.parametrize(("endpoint", "body", "why"), BAD, ids=[b[2] for b in BAD])
def test_bad_input_gets_a_4xx_and_the_server_keeps_serving(
    http: httpx.Client, endpoint: str, body: Any, why: str
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post(PATHS[endpoint], content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error" and err["code"] is None
    ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1


def test_unknown_paths_and_methods(http: httpx.Client) -> None:
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    for method, path, allow in [
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/completions", "POST"),
        ("DELETE", "/generate", "POST"),
        ("POST", "/health", "GET, HEAD"),
        ("PUT", "/v1/models", "GET, HEAD"),
        ("GET", "/flush_cache", "POST"),
    ]:
        r = http.request(method, path)
        assert r.status_code == 405, (method, path)
        assert r.headers["Allow"] == allow  # RFC 9110 requires it with a 405
        assert r.json()["error"]["code"] is None and allow in r.json()["error"]["message"]


def test_head_wherever_get_is_served(http: httpx.Client) -> None:
    for path in ("/health", "/v1/models", "/metrics", "/openapi.json"):
        got, headed = http.get(path), http.head(path)
        assert headed.status_code == got.status_code == 200, path
        assert headed.content == b""
        assert headed.headers["content-type"] == got.headers["content-type"]


# Strict where OpenAI is strict: a boolean is not a number, a number is not a string, and
# the ranges are OpenAI's; the error names the field.
STRICT = [
    ("chat", {**MSG, "max_tokens": True}, "max_tokens"),
    ("chat", {**MSG, "n": True}, "n"),
    ("chat", {**MSG, "seed": False}, "seed"),
    ("chat", {**MSG, "max_tokens": 4.0}, "max_tokens"),
    ("chat", {**MSG, "temperature": "0.5"}, "temperature"),
    ("chat", {**MSG, "temperature": 2.5}, "temperature"),
    ("chat", {**MSG, "temperature": 1e308}, "temperature"),
    ("chat", {**MSG, "temperature": True}, "temperature"),
    ("chat", {**MSG, "top_p": 1.01}, "top_p"),
    ("chat", {**MSG, "presence_penalty": 2.5}, "presence_penalty"),
    ("chat", {**MSG, "frequency_penalty": -2.01}, "frequency_penalty"),
    ("chat", {**MSG, "stream": 1}, "stream"),
    ("chat", {**MSG, "logprobs": 1}, "logprobs"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("completions", {"prompt": [False]}, "prompt"),
    ("completions", {"prompt": [[False]]}, "prompt"),
    ("completions", {"prompt": [1, True]}, "prompt"),
    ("completions", {"prompt": "hi", "stop": [1]}, "stop"),
    ("completions", {"prompt": "hi", "extra_body": 1}, "extra_body"),
    ("generate", {"input_ids": [False]}, "input_ids.0"),
    ("generate", {"input_ids": [1.0]}, "input_ids.0"),
    ("generate", {"text": "a", "sampling_params": {"max_new_tokens": True}}, None),
    ("generate", {"text": "a", "sampling_params": {"stop_token_ids": [True]}}, None),
]


@pytest.mark.parametrize(
    ("endpoint", "body", "param"), STRICT, ids=[json.dumps(b[1]) for b in STRICT]
)
def test_strict_types_and_ranges(
    http: httpx.Client, endpoint: str, body: Any, param: str | None
) -> None:
    r = http.post(PATHS[endpoint], json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if param is None:
        assert err["param"].startswith("sampling_params.")
    else:
        assert err["param"] == param and err["message"].startswith(f"{param}: ")


def test_null_is_a_field_left_out(http: httpx.Client) -> None:
    """Every field OpenAI marks nullable takes an explicit null (clients send them)."""
    nullable = ["model", "temperature", "top_p", "n", "stop", "seed", "presence_penalty"]
    nullable += ["frequency_penalty", "stream", "stream_options", "user", "logit_bias"]
    base = {k: None for k in nullable}
    chat_nulls = {**base, "max_completion_tokens": None, "logprobs": None, "top_logprobs": None}
    chat_nulls |= {"tools": None, "tool_choice": None, "response_format": None}
    chat_nulls |= {"parallel_tool_calls": None, "functions": None, "function_call": None}
    r = http.post("/v1/chat/completions", json={**MSG, **chat_nulls, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    completion_nulls = {**base, "logprobs": None, "echo": None, "best_of": None, "suffix": None}
    r = http.post("/v1/completions", json={"prompt": "Hi", **completion_nulls, "max_tokens": None})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16  # max_tokens: null is OpenAI's default
    options = {"stream": True, "stream_options": {"include_usage": None}, "max_tokens": 1}
    events = http.post("/v1/completions", json={"prompt": "Hi", **options}).text
    assert '"usage": null' not in events  # include_usage: null is false


def test_openai_client_sees_bad_requests(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, max_tokens=100_000)
    assert e.value.body["param"] == "max_tokens"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):  # refused before the stream starts
        chat(client, max_tokens=100_000, stream=True)


# ---- one output pipeline: the offline LLM and the server answer alike ---------------------------


def both_doors(
    stack: Stack, client: openai.OpenAI, http: httpx.Client, prompt: list[int], **sp: Any
) -> dict[str, Any]:
    """The offline answer to a greedy request, after checking that the server gives the same
    through `/generate` (text, ids, finish reason, usage, matched stop) and through the openai
    client's completions (text, finish reason, usage)."""
    off = stack.llm.generate([prompt], SamplingParams(temperature=0, **sp), use_tqdm=False)[0]
    native = {("max_new_tokens" if k == "max_tokens" else k): v for k, v in sp.items()}
    native["temperature"] = 0
    body = http.post("/generate", json={"input_ids": prompt, "sampling_params": native}).json()
    meta = body["meta_info"]
    got = (body["text"], body["output_ids"], meta["finish_reason"], meta["completion_tokens"])
    want = (off["text"], off["token_ids"], off["finish_reason"], off["completion_tokens"])
    assert got == want, sp
    assert meta["matched_stop"] == off["matched_stop"]
    extra = {k: v for k, v in sp.items() if k not in ("max_tokens", "stop")}
    r = client.completions.create(
        model="default",
        prompt=prompt,
        max_tokens=sp["max_tokens"],
        temperature=0,
        stop=list(sp.get("stop", [])) or None,
        extra_body=extra,
    )
    c = r.choices[0]
    assert (c.text, c.finish_reason, r.usage.completion_tokens) == want[:1] + want[2:], sp
    return off


@dataclass
class Greedy:
    prompt: list[int]
    ids: list[int]
    text: str
    offsets: list[int]  # offsets[j]: where token j's text starts (len of the first j decoded)


@pytest.fixture(scope="module")
def essay(stack: Stack) -> Greedy:
    """An unconstrained greedy answer with words of several tokens: the cases below pick their
    stop strings from it, so that they really trigger."""
    prompt = stack.llm.apply_chat_template(
        [{"role": "user", "content": "Describe the sea in two sentences."}]
    )
    out = stack.llm.generate([prompt], SamplingParams(max_tokens=64, temperature=0), use_tqdm=False)
    ids, text = out[0]["token_ids"][:-1], out[0]["text"]  # without its EOS
    assert out[0]["finish_reason"] == "stop" and len(ids) > 20, out
    tok = stack.llm.tokenizer
    offsets = [len(tok.decode(ids[:j], skip_special_tokens=True)) for j in range(len(ids) + 1)]
    assert offsets[-1] == len(text)
    return Greedy(prompt, ids, text, offsets)


def split_stop(g: Greedy, after: int) -> tuple[str, int]:
    """A stop string that starts inside one token and ends inside a later one (first found at
    that place in the text), at or after token `after`; and the index of its last token."""
    for j in range(after, len(g.ids) - 1):
        a, b, c = g.offsets[j], g.offsets[j + 1], g.offsets[j + 2]
        if b - a >= 2 and c - b >= 2:  # two tokens of at least two characters
            stop = g.text[a + 1 : b + 1]
            if g.text.find(stop) == a + 1 and g.text[b:c].strip():
                return stop, j + 1
    raise AssertionError(f"no stop string spans two tokens in {g.text!r}")


def test_stop_strings_split_across_tokens_answer_alike(
    stack: Stack, client: openai.OpenAI, http: httpx.Client, essay: Greedy
) -> None:
    stop, last = split_stop(essay, 4)
    out = both_doors(stack, client, http, essay.prompt, max_tokens=64, stop=[stop])
    assert out["text"] == essay.text[: essay.text.index(stop)]
    assert out["token_ids"] == essay.ids[: last + 1]  # the token completing it is the last
    assert (out["finish_reason"], out["matched_stop"]) == ("stop", stop)
    kept = both_doors(
        stack,
        client,
        http,
        essay.prompt,
        max_tokens=64,
        stop=[stop],
        include_stop_str_in_output=True,
    )
    assert kept["text"] == essay.text[: essay.text.index(stop) + len(stop)]


def test_a_stop_completed_by_the_last_allowed_token_answers_stop(
    stack: Stack, client: openai.OpenAI, http: httpx.Client, essay: Greedy
) -> None:
    stop, last = split_stop(essay, 10)
    out = both_doors(stack, client, http, essay.prompt, max_tokens=last + 1, stop=[stop])
    assert out["finish_reason"] == "stop" and out["completion_tokens"] == last + 1
    shorter = both_doors(stack, client, http, essay.prompt, max_tokens=last, stop=[stop])
    assert shorter["finish_reason"] == "length" and shorter["matched_stop"] is None


def test_stop_token_ids_answer_alike(
    stack: Stack, client: openai.OpenAI, http: httpx.Client, essay: Greedy
) -> None:
    j = next(j for j in range(5, len(essay.ids)) if essay.ids.index(essay.ids[j]) == j)
    token = essay.ids[j]
    out = both_doors(stack, client, http, essay.prompt, max_tokens=64, stop_token_ids=[token])
    assert out["token_ids"] == essay.ids[: j + 1]  # kept and counted ...
    assert out["text"] == essay.text[: essay.offsets[j]]  # ... but not text
    assert (out["finish_reason"], out["matched_stop"]) == ("stop", token)


@pytest.fixture(scope="module")
def france(stack: Stack) -> Greedy:
    """The greedy answer to FRANCE, which ends early with EOS, continued past it."""
    prompt = stack.llm.apply_chat_template(FRANCE)
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, skip_special_tokens=False)
    out = stack.llm.generate([prompt], sp, use_tqdm=False)[0]
    assert "<|im_end|>" in out["text"], out["text"]
    return Greedy(prompt, out["token_ids"], out["text"], [])


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_answer_alike(
    stack: Stack, client: openai.OpenAI, http: httpx.Client, france: Greedy, skip: bool
) -> None:
    kw: dict[str, Any] = {"max_tokens": 12, "skip_special_tokens": skip}
    eos = both_doors(stack, client, http, france.prompt, **kw)  # ends at EOS
    assert (eos["finish_reason"], eos["matched_stop"]) == ("stop", EOS)
    assert eos["token_ids"][-1] == EOS and "<|im_end|>" not in eos["text"]
    free = both_doors(stack, client, http, france.prompt, ignore_eos=True, **kw)
    assert free["token_ids"] == france.ids and ("<|im_end|>" in free["text"]) == (not skip)
    # A stop string that spans the special token's text matches only when that text is there.
    at = france.text.index("<|im_end|>")
    stop = france.text[at - 1 : at + 5]
    out = both_doors(stack, client, http, france.prompt, ignore_eos=True, stop=[stop], **kw)
    assert out["finish_reason"] == ("length" if skip else "stop")


def test_min_tokens_outlasts_eos_and_stop_strings(
    stack: Stack, client: openai.OpenAI, http: httpx.Client, france: Greedy
) -> None:
    n_eos = france.ids.index(EOS)  # where EOS would end it
    out = both_doors(stack, client, http, france.prompt, max_tokens=12, min_tokens=n_eos + 3)
    assert len(out["token_ids"]) >= n_eos + 3 and EOS not in out["token_ids"][: n_eos + 3]
    assert out["text"].startswith(france.text[: france.text.index("<|im_end|>")])


def test_min_tokens_skips_stop_strings_before_it(
    stack: Stack, client: openai.OpenAI, http: httpx.Client, essay: Greedy
) -> None:
    m = 4
    head, tail = essay.text[: essay.offsets[m]], essay.text[essay.offsets[m] :]
    stop = next(ch for ch in head if ch.strip() and ch in tail)  # in the first m tokens, and later
    early = both_doors(stack, client, http, essay.prompt, max_tokens=64, stop=[stop])
    assert early["text"] == essay.text[: essay.text.index(stop)]
    out = both_doors(stack, client, http, essay.prompt, max_tokens=64, stop=[stop], min_tokens=m)
    at = essay.offsets[m] + tail.index(stop)  # the first one a token after the m-th completes
    assert out["text"] == essay.text[:at] and out["matched_stop"] == stop
    assert (
        out["token_ids"] == essay.ids[: max(j for j, o in enumerate(essay.offsets) if o <= at) + 1]
    )


def test_matched_stop_in_generate_meta_info(http: httpx.Client, france: Greedy) -> None:
    def meta(**sp: Any) -> dict[str, Any]:
        sp = {"max_new_tokens": 12, "temperature": 0, **sp}
        body = {"input_ids": france.prompt, "sampling_params": sp}
        return dict(http.post("/generate", json=body).json()["meta_info"])

    assert meta()["matched_stop"] == EOS
    assert meta(stop=["Paris"])["matched_stop"] == "Paris"
    assert meta(max_new_tokens=2)["matched_stop"] is None  # length
    events = http.post(
        "/generate",
        json={
            "input_ids": france.prompt,
            "stream": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "stop": ["Paris"]},
        },
    ).text.split("\n\n")
    last = json.loads(next(e for e in reversed(events) if e.startswith("data: {"))[6:])
    assert last["meta_info"]["matched_stop"] == "Paris"


def test_min_tokens_above_max_tokens_is_refused(http: httpx.Client, client: openai.OpenAI) -> None:
    sp = {"max_new_tokens": 4, "min_tokens": 5}
    r = http.post("/generate", json={"text": "Hi", "sampling_params": sp})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, max_tokens=3, extra_body={"min_tokens": 4})
    assert e.value.body["param"] == "min_tokens"  # type: ignore[index]
    r = http.post("/v1/completions", json={"prompt": "Hi", "min_tokens": -1})
    assert r.status_code == 400
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)


# ---- schemathesis ----------------------------------------------------------------------------

SCHEMA_EXAMPLES = 25


def _shorten(value: Any, limit: int = 400) -> Any:
    """Long generated strings become long prompts, whose CPU prefill is slow and tests nothing
    here (too-long prompts have their own test); keep every string short."""
    if isinstance(value, str):
        return value[:limit]
    if isinstance(value, list):
        return [_shorten(v, limit) for v in value[:16]]
    if isinstance(value, dict):
        return {k: _shorten(v, limit) for k, v in value.items()}
    return value


def cap_generation(path: str, body: Any) -> None:
    """Keep generated requests cheap: at most 2 new tokens and 2 choices each, short strings
    (the shapes are what is tested here, not long generations)."""
    if not isinstance(body, dict):
        return
    for key, value in list(body.items()):
        body[key] = _shorten(value)
    target = body.get("sampling_params") if path == "/generate" else body
    if path == "/generate" and target is None:
        target = body["sampling_params"] = {}
    if not isinstance(target, dict):
        return
    if isinstance(body.get("model"), str):  # a generated name would only reach the 404
        body["model"] = "default"
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2
    for key in ("max_tokens", "max_completion_tokens", "max_new_tokens"):
        value = target.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 2:
            target[key] = 2
    # A missing or null limit means "the rest of the context" (thousands of CPU decode steps).
    if path == "/generate":
        if target.get("max_new_tokens") is None:
            target["max_new_tokens"] = 2
    elif target.get("max_tokens") is None and target.get("max_completion_tokens") is None:
        target["max_tokens"] = 2


def test_openapi_describes_what_the_server_answers(http: httpx.Client) -> None:
    doc = http.get("/openapi.json").json()
    error_ref = {"$ref": "#/components/schemas/ErrorBody"}
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            answers = op["responses"]
            assert "422" not in answers, (method, path)  # invalid bodies get 400
            assert "401" in answers or path == "/health"  # the server has a key
            for code, answer in answers.items():
                if int(code) >= 400:
                    assert answer["content"] == {"application/json": {"schema": error_ref}}
    for path in ("/v1/chat/completions", "/v1/completions", "/generate"):
        answers = doc["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "408", "413", "503"} <= set(answers)
        assert set(answers["200"]["content"]) == {"application/json", "text/event-stream"}
    assert {"200", "400", "413", "503"} <= set(doc["paths"]["/flush_cache"]["post"]["responses"])
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "ValidationError" not in doc["components"]["schemas"]


def test_the_key_from_a_file_works_and_is_never_shown(server: Server, http: httpx.Client) -> None:
    assert http.get("/v1/models").status_code == 200  # every test here authenticates
    assert API_KEY not in http.get("/metrics").text
    assert API_KEY not in server.log_text()


def test_schemathesis_finds_no_nonconformance(server: Server, http: httpx.Client) -> None:
    """Generated requests, valid and invalid, against /openapi.json: no 5xx, and every status
    code, content type and body as documented."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.errors import FailureGroup
    from schemathesis.generation import GenerationMode
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
    ]
    schema = schemathesis.openapi.from_dict(http.get("/openapi.json").json())
    failures: list[str] = []
    for result in schema.get_all_operations():
        op = result.ok()
        # Operations without parameters or body have no invalid inputs to generate.
        has_body = len(op.body) > 0
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)[: 1 + has_body]:

            @settings(
                max_examples=SCHEMA_EXAMPLES,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
                phases=[Phase.generate],
            )
            @given(case=op.as_strategy(generation_mode=mode))
            def check(case: Any) -> None:
                cap_generation(case.path, case.body)
                try:
                    case.call_and_validate(
                        base_url=server.url, headers=server.headers, timeout=600, checks=checks
                    )
                except FailureGroup as e:
                    failures.append(f"{case.method} {case.path} {case.body!r}: {str(e)[:800]}")

            check()
    assert not failures, "\n".join(failures[:10])
    assert http.get("/health").status_code == 200
