"""The real chat templates of tool-calling model families (Qwen2.5, Qwen3, Llama 3.x, Mistral,
DeepSeek-R1), as llama.cpp's source distribution on PyPI ships them: fetched when the tests run
(never committed), rendered through the tokenizer worker's own path with tools, an assistant
turn with tool calls and a tool answer; and each parser on the calls those formats write."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from minisgl.message import ChatMessage, ChatOptions, ToolCall
from minisgl.tokenizer.parsers import ReasoningSplitter, detect_tool_call_parser, tool_call_parser
from minisgl.tokenizer.tokenize import chat_prompt

SDIST = "llama_cpp_python-0.3.36.tar.gz"
REQUIREMENT = "llama-cpp-python==0.3.36"
CACHE = Path(os.environ.get("MINISGL_TEST_CACHE", Path.home() / ".cache" / "minisgl-tests"))
TEMPLATES = "vendor/llama.cpp/models/templates"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL_ID = "abc123XYZ"  # Mistral's templates take 9 alphanumeric characters only
CONVERSATION = [
    ChatMessage("system", "You are helpful."),
    ChatMessage("user", "Weather in Paris?"),
    ChatMessage(
        "assistant", "", tool_calls=[ToolCall(CALL_ID, "get_weather", '{"city": "Paris"}')]
    ),
    ChatMessage("tool", "18 C", tool_call_id=CALL_ID),
]


@pytest.fixture(scope="module")
def templates() -> Path:
    """The sdist's template folder, unpacked in the cache (downloaded first if not there)."""
    sdist = CACHE / SDIST
    if not sdist.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        done = subprocess.run(
            [*cmd, REQUIREMENT, "-d", str(CACHE)], capture_output=True, timeout=300
        )
        if done.returncode != 0 or not sdist.exists():
            pytest.skip(f"PyPI unreachable, no {SDIST} in {CACHE}: {done.stderr[-300:]!r}")
    out = CACHE / "templates"
    if not out.exists():
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if f"/{TEMPLATES}/" in m.name and m.isfile()]
            for m in members:
                m.name = Path(m.name).name
            tar.extractall(out, members=members, filter="data")
    return out


def render(tokenizer: Any, template: str, **options: Any) -> str:
    tok = copy.copy(tokenizer)
    tok.chat_template = template
    return chat_prompt(tok, CONVERSATION, ChatOptions(tools=[WEATHER_TOOL], **options))


def only_call(delta: Any) -> tuple[str, str]:
    assert len(delta.calls) == 1, delta
    return delta.calls[0].name, delta.calls[0].arguments


@pytest.mark.parametrize("name", ["Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B"])
def test_qwen_hermes(templates: Path, tokenizer: Any, name: str) -> None:
    template = (templates / f"{name}.jinja").read_text()
    assert detect_tool_call_parser(template) == "hermes"
    text = render(tokenizer, template)
    assert "<tools>" in text and '"name": "get_weather"' in text
    assert "<tool_response>\n18 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    turn = text[text.index("<|im_start|>assistant") : text.index("<tool_response>")]
    d = tool_call_parser("hermes").parse(turn.removeprefix("<|im_start|>assistant\n"))
    assert only_call(d) == ("get_weather", '{"city": "Paris"}')


def test_qwen3_thinking_off(templates: Path, tokenizer: Any) -> None:
    template = (templates / "Qwen-Qwen3-0.6B.jinja").read_text()
    off = render(tokenizer, template, template_kwargs={"enable_thinking": False})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not render(tokenizer, template).endswith("</think>\n\n")


@pytest.mark.parametrize(
    "name", ["meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct"]
)
def test_llama3_json(templates: Path, tokenizer: Any, name: str) -> None:
    template = (templates / f"{name}.jinja").read_text()
    assert detect_tool_call_parser(template) == "llama3"
    text = render(tokenizer, template)
    assert '"name": "get_weather"' in text and "<|start_header_id|>ipython<|end_header_id|>" in text
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    start = text.index("<|start_header_id|>assistant<|end_header_id|>\n\n")
    turn = text[start:].split("<|end_header_id|>\n\n", 1)[1].split("<|eot_id|>")[0]
    name_, args = only_call(tool_call_parser("llama3").parse(turn))
    assert name_ == "get_weather" and args == '{"city": "Paris"}'
    tagged = tool_call_parser("llama3").parse("<|python_tag|>" + turn)
    assert only_call(tagged) == ("get_weather", '{"city": "Paris"}')


def test_mistral(templates: Path, tokenizer: Any) -> None:
    template = (templates / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text()
    assert detect_tool_call_parser(template) == "mistral"
    text = render(tokenizer, template)
    assert "[AVAILABLE_TOOLS]" in text and "[TOOL_RESULTS]" in text and CALL_ID in text
    turn = text[text.index("[TOOL_CALLS]") :].split(tokenizer.eos_token)[0]
    assert only_call(tool_call_parser("mistral").parse(turn)) == (
        "get_weather",
        '{"city": "Paris"}',
    )


def test_deepseek_v3_1(templates: Path, tokenizer: Any) -> None:
    template = (templates / "deepseek-ai-DeepSeek-V3.1.jinja").read_text()
    assert detect_tool_call_parser(template) == "deepseek"
    text = render(tokenizer, template)
    start = text.index("<｜tool▁calls▁begin｜>")
    turn = text[start : text.index("<｜tool▁calls▁end｜>") + len("<｜tool▁calls▁end｜>")]
    assert only_call(tool_call_parser("deepseek").parse(turn)) == (
        "get_weather",
        '{"city": "Paris"}',
    )


def test_deepseek_r1(templates: Path, tokenizer: Any) -> None:
    template = (templates / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    assert detect_tool_call_parser(template) == "deepseek"
    text = render(tokenizer, template)
    assert "<｜tool▁output▁begin｜>18 C<｜tool▁output▁end｜>" in text
    start = text.index("<｜tool▁calls▁begin｜>")
    turn = text[start : text.index("<｜tool▁calls▁end｜>") + len("<｜tool▁calls▁end｜>")]
    d = tool_call_parser("deepseek").parse(turn)
    assert only_call(d) == ("get_weather", '{"city": "Paris"}') and d.content == ""
    split = ReasoningSplitter("deepseek-r1").split("First, Paris.\n</think>\n\nIt is 18 C.")
    assert split == ("First, Paris.\n", "It is 18 C.")
