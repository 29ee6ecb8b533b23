"""`/generate`: the native endpoint (text or token ids in; text, ids and meta out)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from minisgl.message import GenerateReq, StrOut
from minisgl.server.engine_client import EngineClient
from minisgl.server.protocol import GenerateRequest
from minisgl.server.sampling import generate_req, sampling_params
from minisgl.server.streaming import DONE, Batches, ChoiceResult, answer, sse


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
