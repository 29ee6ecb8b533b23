"""The tokenizer's bookkeeping: a `GenerateReq` becomes one `TokenizedReq` per choice, or an
`InvalidRequestError` that names the field to change."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import jinja2

from minisgl.core import InvalidRequestError
from minisgl.core import resolve_max_tokens as core_resolve_max_tokens
from minisgl.message import (
    ChatMessage,
    ChatOptions,
    EngineInfo,
    GenerateReq,
    TokenizedReq,
    ToolCall,
)
from minisgl.weights import load_tokenizer, resolve_source


def resolve_max_tokens(prompt_len: int, max_tokens: int | None, info: EngineInfo) -> int:
    """`max_tokens` checked against the engine's context and KV pool (the scheduler's own
    limits); None becomes all the room the prompt leaves."""
    pool_tokens = info.num_pages * info.page_size
    return core_resolve_max_tokens(prompt_len, max_tokens, info.max_context, pool_tokens)


# apply_chat_template's own parameters, which `chat_template_kwargs` must not override.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "tools", "documents", "add_generation_prompt", "tokenize", "chat_template",
     "return_dict", "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs",
     "continue_final_message", "return_assistant_tokens_mask"}
)  # fmt: skip


def template_message(m: ChatMessage) -> dict[str, Any]:
    """A message as chat templates take it (Hugging Face's convention): `developer` is the
    system prompt, and a call's arguments are an object where they parse as one."""
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
    out["content"] = m.content
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
            for c in m.tool_calls
        ]  # fmt: skip
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text


def message_from_dict(m: dict[str, Any]) -> ChatMessage:
    """An OpenAI-style message (the offline API's conversations) as the server's `ChatMessage`:
    string content or text parts, an assistant's `tool_calls` with JSON-text arguments."""
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content)
    calls = [
        ToolCall(c.get("id", ""), c["function"]["name"], _arguments_text(c["function"]))
        for c in m.get("tool_calls") or ()
    ]
    return ChatMessage(m["role"], content or "", m.get("name"), calls, m.get("tool_call_id"))


def _arguments_text(function: dict[str, Any]) -> str:
    args = function.get("arguments", "{}")
    return args if isinstance(args, str) else json.dumps(args)


def chat_prompt(
    tokenizer: Any, messages: list[ChatMessage], chat: ChatOptions | None = None
) -> str:
    """The conversation rendered by the chat template, with its tools and documents."""
    chat = chat or ChatOptions()
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "messages: this model's tokenizer has no chat template; send a prompt to "
            "/v1/completions instead (or start the server with --chat-template)"
        )
    reserved = sorted(set(chat.template_kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise InvalidRequestError(
            f"chat_template_kwargs: {reserved[0]!r} is set by the server; remove it"
        )
    try:
        text = tokenizer.apply_chat_template(
            [template_message(m) for m in messages],
            tools=chat.tools or None,
            documents=chat.documents or None,
            add_generation_prompt=True,
            tokenize=False,
            **chat.template_kwargs,
        )
    except jinja2.TemplateError as e:
        # Templates reject conversations they cannot render (say, roles out of order).
        raise InvalidRequestError(f"messages: the chat template refused them: {e}") from e
    assert isinstance(text, str)
    return text


def chat_ids(
    tokenizer: Any, messages: list[ChatMessage], chat: ChatOptions | None = None
) -> list[int]:
    # What apply_chat_template(tokenize=True) does: the template's text holds its special tokens
    # already.
    text = chat_prompt(tokenizer, messages, chat)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def single_token(tokenizer: Any, text: str | None) -> int | None:
    """The id of the vocabulary token spelled `text`, if there is one."""
    if text is None:
        return None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return int(ids[0]) if len(ids) == 1 else None


def prompt_ids(tokenizer: Callable[[], Any], prompt: str | list[int], vocab: int) -> list[int]:
    """A text prompt's token ids (`tokenizer()` gives the tokenizer), or token ids checked
    against the vocabulary."""
    if isinstance(prompt, str):
        return list(tokenizer()(prompt)["input_ids"])
    ids = [int(t) for t in prompt]
    if any(not 0 <= t < vocab for t in ids):
        raise InvalidRequestError(f"prompt: token ids must be in [0, {vocab})")
    return ids


class RequestTokenizer:
    def __init__(self, tokenizer: Any, info: EngineInfo) -> None:
        self.tokenizer = tokenizer
        self.info = info

    def prompt_ids(self, req: GenerateReq) -> list[int]:
        if req.messages is not None:
            return chat_ids(self.tokenizer, req.messages, req.chat)
        prompt = req.text if req.text is not None else req.input_ids
        assert prompt is not None
        return prompt_ids(lambda: self.tokenizer, prompt, self.info.vocab_size)

    def tokenize(self, req: GenerateReq) -> list[TokenizedReq]:
        req.params.check_vocab(self.info.vocab_size)
        ids = self.prompt_ids(req)
        max_tokens = resolve_max_tokens(len(ids), req.max_tokens, self.info)
        params = replace(
            req.params,
            max_tokens=max_tokens,
            grammar_after_token=single_token(self.tokenizer, req.grammar_after),
        )
        return [
            TokenizedReq(rid, ids, params, seed)
            for rid, seed in zip(req.rids, req.seeds, strict=True)
        ]


# Texts a tokenizer must give back unchanged (decode(encode(x)) == x) for its longest token to
# bound how many characters a token can stand for: whitespace runs, long words, combining and
# control characters, emoji, a special token's text.
_ROUND_TRIP_PROBES = (
    "Hello,   world!\n\n\t x  ",
    "a" * 300 + " " * 300 + "b",
    "é中文🙂\u0301\u200b z",
    "\x00\x01 control <|im_start|> <s> </s>",
)


def max_token_chars(tokenizer: Any) -> int | None:
    """The characters of the vocabulary's longest token (special tokens included), a bound on
    how many characters of a prompt one token can consume; None when the tokenizer loses text
    (drops whitespace, folds unknown words into one token), where no such bound holds."""
    for text in _ROUND_TRIP_PROBES:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        back = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if back != text:
            return None
    # A token's string spells its bytes (byte-level BPE) or its characters (SentencePiece,
    # with "<0xNN>" byte tokens): never fewer characters than it decodes to.
    return max(len(token) for token in tokenizer.get_vocab())


# ---- loading the tokenizer once, and handing it to sibling processes cheaply ---------------------
# Loading the model's tokenizer once and handing it to sibling processes cheaply.
#
# Building a tokenizer from a GGUF file converts its vocabulary (seconds); a saved copy in HF
# format loads in a fraction of that, so the tokenizer worker saves one for the detokenizer.


def load_and_save(
    model: str | None, directory: str | Path, chat_template: str | None = None
) -> Any:
    """The model's tokenizer (with `chat_template` in place of its own, when given), also
    saved in `directory`."""
    tokenizer = load_tokenizer(resolve_source(model))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def load_saved(directory: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))
