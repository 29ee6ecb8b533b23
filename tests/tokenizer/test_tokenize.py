"""A GenerateReq becomes one TokenizedReq per choice, or an error naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from minisgl.core import InvalidRequestError, SamplingParams
from minisgl.message import ChatMessage, ChatOptions, EngineInfo, GenerateReq, ToolCall
from minisgl.tokenizer.tokenize import (
    RequestTokenizer,
    chat_prompt,
    max_token_chars,
    resolve_max_tokens,
)

INFO = EngineInfo("m", max_context=64, num_pages=100, page_size=1, vocab_size=49152)


def test_max_tokens_defaults_to_the_room_left() -> None:
    assert resolve_max_tokens(10, None, INFO) == 54
    assert resolve_max_tokens(10, 54, INFO) == 54
    small_pool = EngineInfo("m", max_context=64, num_pages=5, page_size=8, vocab_size=10)
    assert resolve_max_tokens(10, None, small_pool) == 30  # the pool is the tighter limit


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "field"),
    [(0, 1, "prompt"), (64, None, "prompt"), (70, 1, "prompt"), (10, 55, "max_tokens")],
)
def test_what_cannot_fit_is_refused(prompt_len: int, max_tokens: int | None, field: str) -> None:
    with pytest.raises(InvalidRequestError, match=f"^{field}:"):
        resolve_max_tokens(prompt_len, max_tokens, INFO)


def req(**prompt: Any) -> GenerateReq:
    return GenerateReq(["a", "b"], [7, 8], SamplingParams(temperature=0.5), None, **prompt)


def test_choices_share_the_prompt_with_their_own_seeds(tokenizer: Any) -> None:
    out = RequestTokenizer(tokenizer, INFO).tokenize(req(text="Hello world"))
    assert [r.rid for r in out] == ["a", "b"] and [r.seed for r in out] == [7, 8]
    ids = tokenizer("Hello world")["input_ids"]
    assert all(r.input_ids == ids for r in out)
    assert all(r.params.max_tokens == 64 - len(ids) for r in out)
    assert out[0].params.temperature == 0.5


def test_chat_uses_the_template(tokenizer: Any) -> None:
    out = RequestTokenizer(tokenizer, INFO).tokenize(req(messages=[ChatMessage("user", "Hi")]))
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True
    )
    expected = expected["input_ids"] if not isinstance(expected, list) else expected
    assert out[0].input_ids == list(expected)


def test_chat_without_a_template_is_a_request_error(tokenizer: Any) -> None:
    """A tokenizer with no chat template (a base model's): the chat request is refused with a
    400-class error naming `messages`; the tokenizer is left as it was."""
    import copy

    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    with pytest.raises(InvalidRequestError, match="^messages: .*no chat template"):
        RequestTokenizer(plain, INFO).tokenize(req(messages=[ChatMessage("user", "Hi")]))
    assert tokenizer.chat_template


def test_token_ids_outside_the_vocabulary_are_refused(tokenizer: Any) -> None:
    with pytest.raises(InvalidRequestError, match="^prompt:"):
        RequestTokenizer(tokenizer, INFO).tokenize(req(input_ids=[1, 49152]))


def test_too_long_prompt_is_refused(tokenizer: Any) -> None:
    with pytest.raises(InvalidRequestError, match="^prompt:.*context of 64"):
        RequestTokenizer(tokenizer, INFO).tokenize(req(text="word " * 100))


def test_no_token_stands_for_more_characters_than_the_bound(tokenizer: Any) -> None:
    bound = max_token_chars(tokenizer)
    assert bound is not None
    longest = max(len(tokenizer.decode([i])) for i in range(len(tokenizer)))
    assert longest <= bound
    # The prompts that pack the most characters into each token still fit the bound.
    for text in ["#" * 5000, "\n" + " " * 5000, "=" * 5000, "<|im_start|>" * 100]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(text) <= len(ids) * bound


def test_a_tokenizer_that_loses_text_has_no_bound(tmp_path: Path) -> None:
    # Word-level: whitespace runs vanish and any unknown word becomes one token.
    from minisgl.benchmark.serving import synthetic_tokenizer_model
    from minisgl.tokenizer.tokenize import load_saved

    config_dir = Path(__file__).parents[2] / "minisgl/benchmark/models/qwen3-0.6b"
    words = load_saved(synthetic_tokenizer_model(str(config_dir), tmp_path))
    assert len(words("x" * 10_000)["input_ids"]) == 1
    assert max_token_chars(words) is None


def test_grammar_starts_after_a_single_token_only(tokenizer: Any) -> None:
    """The end-of-thinking text becomes the grammar's start token when the vocabulary has it
    as one token (SmolLM2 has `<|im_end|>`, not `</think>`)."""
    rt = RequestTokenizer(tokenizer, INFO)
    for text, expected in (("<|im_end|>", 2), ("</think>", None), (None, None)):
        r = req(text="Hi", grammar_after=text)
        assert rt.tokenize(r)[0].params.grammar_after_token == expected


def test_developer_tools_and_tool_messages_reach_the_template(tokenizer: Any) -> None:
    import copy

    tok = copy.copy(tokenizer)
    tok.chat_template = (
        "{% for m in messages %}[{{ m.role }}|{{ m.content }}|{{ m.tool_call_id }}|"
        "{% for c in m.tool_calls or [] %}{{ c.function.name }}{{ c.function.arguments.x }}"
        "{% endfor %}]{% endfor %}{{ tools | length }}{{ flag }}"
    )
    messages = [
        ChatMessage("developer", "Be brief."),
        ChatMessage("assistant", "", tool_calls=[ToolCall("c1", "f", '{"x": 5}')]),
        ChatMessage("tool", "ok", tool_call_id="c1"),
    ]
    options = ChatOptions(tools=[{"type": "function", "function": {"name": "f"}}],
                          template_kwargs={"flag": "!"})  # fmt: skip
    text = chat_prompt(tok, messages, options)
    assert text == "[system|Be brief.||][assistant|||f5][tool|ok|c1|]1!"
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs: 'tokenize'"):
        chat_prompt(tok, messages, ChatOptions(template_kwargs={"tokenize": 1}))
