"""`/tokenize`, `/detokenize` and `/version` in vLLM's request and response shapes.

The API process loads the tokenizer worker's saved copy of the tokenizer on the first call
(a fraction of a second for the saved HF format) and runs it on a thread, so tokenizing never
waits on the scheduler and the scheduler never waits on it.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from minisgl import __version__
from minisgl.server.errors import ApiError
from minisgl.server.models import ServedModels
from minisgl.server.openapi import Detokenized, Tokenized, Version, responses
from minisgl.tokenizer.loading import load_saved


class TokenizeRequest(BaseModel):
    """Either `prompt` (text) or `messages` (a chat, rendered by the model's chat template)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    # Default: true for a prompt (BOS and the like, as a completion request adds them), false
    # for messages (the chat template writes them itself).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int] = Field(..., description="token ids")


class TokenizerHost:
    """The API process's own tokenizer, loaded once from `directory` on first use."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @functools.cached_property
    def tokenizer(self) -> Any:
        return load_saved(self.directory)

    async def run(self, fn: Callable[[Any], Any]) -> Any:
        return await asyncio.to_thread(lambda: fn(self.tokenizer))


def tokenize(tok: Any, body: TokenizeRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "prompt: give either `prompt` or `messages`", "prompt")
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        return list(tok.encode(body.prompt, add_special_tokens=special))
    try:
        text = tok.apply_chat_template(
            body.messages, tokenize=False, add_generation_prompt=body.add_generation_prompt
        )
    except Exception as e:  # the template's own complaint about the messages (Jinja, KeyError)
        raise ApiError(400, f"messages: the chat template refused them: {e}", "messages") from e
    return list(tok.encode(text, add_special_tokens=bool(body.add_special_tokens)))


def detokenize(tok: Any, tokens: list[int]) -> str:
    bad = [t for t in tokens if not 0 <= t < len(tok)]
    if bad:
        raise ApiError(400, f"tokens: {bad[0]} is not a token id (0..{len(tok) - 1})", "tokens")
    return str(tok.decode(tokens))


def add_tokenize_routes(
    app: FastAPI,
    host: TokenizerHost,
    served: ServedModels,
    posted: tuple[int, ...],
    got: tuple[int, ...],
) -> None:
    """`posted`: the error codes of a POST route that names a model; `got`: a GET route's."""

    @app.post("/tokenize", responses=responses(Tokenized, *posted))
    async def tokenize_route(body: TokenizeRequest) -> JSONResponse:
        served.check(body.model)
        tokens = await host.run(lambda tok: tokenize(tok, body))
        strs = await host.run(lambda tok: tok.convert_ids_to_tokens(tokens))
        return JSONResponse(
            {
                "count": len(tokens),
                "max_model_len": served.max_context,
                "tokens": tokens,
                "token_strs": strs if body.return_token_strs else None,
            }
        )

    @app.post("/detokenize", responses=responses(Detokenized, *posted))
    async def detokenize_route(body: DetokenizeRequest) -> JSONResponse:
        served.check(body.model)
        return JSONResponse({"prompt": await host.run(lambda tok: detokenize(tok, body.tokens))})

    @app.get("/version", responses=responses(Version, *got))
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})
