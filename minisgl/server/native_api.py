"""The native endpoints: `/generate` (text or token ids in; text, ids and meta out), and
`/tokenize`, `/detokenize` in vLLM's request and response shapes.

For the latter the API process loads the tokenizer worker's saved copy of the tokenizer on the
first call (a fraction of a second for the saved HF format) and runs it on a thread, so
tokenizing never waits on the scheduler and the scheduler never waits on it.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from minisgl.message import GenerateReq, StrOut
from minisgl.server.engine_client import EngineClient
from minisgl.server.errors import ApiError
from minisgl.server.protocol import GenerateRequest
from minisgl.server.sampling import generate_req, sampling_params
from minisgl.server.streaming import DONE, Batches, ChoiceResult, answer, sse
from minisgl.tokenizer.tokenize import load_saved


def _request(body: GenerateRequest) -> GenerateReq:
    sp = body.sampling_params
    params, grammar_field = sampling_params(sp, sp.logprobs or sp.top_logprobs > 0, sp.top_logprobs)
    prompt = {"text": body.text, "input_ids": body.input_ids}
    return generate_req(1, sp.seed, params, sp.max_new_tokens, grammar_field, **prompt)


def _meta(
    rid: str, r: ChoiceResult | StrOut, logprobs: bool, token_times: list[float] | None = None
) -> dict[str, Any]:
    """`token_times`: the finished answer's, when the request asked for them."""
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": r.finish_reason,
        "matched_stop": r.matched_stop,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "cached_tokens": r.cached_tokens,
    }
    if logprobs:
        meta["output_token_logprobs"] = [
            {
                "token_id": t.token_id,
                "token": t.token,
                "logprob": t.logprob,
                "top_logprobs": [{"token": x.token, "logprob": x.logprob} for x in t.top],
            }
            for t in r.logprobs
        ]
    if token_times is not None:
        meta["token_times"] = token_times
    return meta


async def generate(request: Request, body: GenerateRequest, client: EngineClient) -> Response:
    req = _request(body)
    want_lp, want_times = req.params.logprobs, body.return_token_times

    def whole(results: list[ChoiceResult]) -> dict[str, Any]:
        [r] = results
        meta = _meta(req.rids[0], r, want_lp, r.token_times if want_times else None)
        return {"text": r.text, "output_ids": r.ids, "meta_info": meta}

    async def events(batches: Batches) -> AsyncIterator[bytes]:
        times: list[float] = []
        async for batch in batches:
            for co in batch:
                times += co.out.token_times
                last = want_times and co.out.finished
                meta = _meta(req.rids[0], co.out, want_lp, times if last else None)
                yield sse({"text": co.out.text, "output_ids": co.out.new_ids, "meta_info": meta})
        yield DONE

    return await answer(request, client, [req], 1, body.stream, events, whole)


# ---- /tokenize and /detokenize ---------------------------------------------------------------


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


async def tokenized(host: TokenizerHost, body: TokenizeRequest, max_context: int) -> dict[str, Any]:
    tokens = await host.run(lambda tok: tokenize(tok, body))
    strs = await host.run(lambda tok: tok.convert_ids_to_tokens(tokens))
    return {
        "count": len(tokens),
        "max_model_len": max_context,
        "tokens": tokens,
        "token_strs": strs if body.return_token_strs else None,
    }
