"""The tokenizer's bookkeeping: a `GenerateReq` becomes one `TokenizedReq` per choice, or an
`InvalidRequestError` that names the field to change."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import jinja2

from minisgl.core import InvalidRequestError
from minisgl.message import ChatMessage, EngineInfo, GenerateReq, TokenizedReq


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def resolve_max_tokens(prompt_len: int, max_tokens: int | None, info: EngineInfo) -> int:
    """`max_tokens` checked against the context and the KV pool (the scheduler's own
    `check_request` limits); None becomes all the room the prompt leaves."""
    if prompt_len < 1:
        raise InvalidRequestError("prompt: must contain at least one token")
    room = min(info.max_context, info.num_pages * info.page_size) - prompt_len
    if room < 1:
        raise InvalidRequestError(
            f"prompt: {prompt_len} tokens do not fit the context of {info.max_context} tokens "
            "(one more is needed to generate); shorten the prompt"
        )
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise InvalidRequestError(
            f"max_tokens: {max_tokens} plus the prompt's {prompt_len} tokens exceed the context "
            f"of {info.max_context} tokens; ask for at most {room}"
        )
    return max_tokens


class RequestTokenizer:
    def __init__(self, tokenizer: Any, info: EngineInfo) -> None:
        self.tokenizer = tokenizer
        self.info = info

    def prompt_ids(self, req: GenerateReq) -> list[int]:
        if req.text is not None:
            return list(self.tokenizer(req.text)["input_ids"])
        if req.messages is not None:
            return self.chat_ids(req.messages)
        assert req.input_ids is not None
        vocab = self.info.vocab_size
        if any(not 0 <= t < vocab for t in req.input_ids):
            raise InvalidRequestError(f"prompt: token ids must be in [0, {vocab})")
        return list(req.input_ids)

    def chat_ids(self, messages: list[ChatMessage]) -> list[int]:
        conv = [{"role": m.role, "content": m.content} for m in messages]
        try:
            out = self.tokenizer.apply_chat_template(
                conv, add_generation_prompt=True, tokenize=True
            )
        except jinja2.TemplateError as e:
            # Templates reject conversations they cannot render (say, roles out of order).
            raise InvalidRequestError(f"messages: the chat template refused them: {e}") from e
        ids = out["input_ids"] if not isinstance(out, list) else out
        return list(ids)

    def tokenize(self, req: GenerateReq) -> list[TokenizedReq]:
        ids = self.prompt_ids(req)
        max_tokens = resolve_max_tokens(len(ids), req.max_tokens, self.info)
        params = replace(req.params, max_tokens=max_tokens)
        return [
            TokenizedReq(rid, ids, params, seed)
            for rid, seed in zip(req.rids, req.seeds, strict=True)
        ]
