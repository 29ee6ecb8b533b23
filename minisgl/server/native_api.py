"""`/generate`: the native endpoint (text or token ids in; text, ids and meta out)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from minisgl.message import GenerateReq, StrOut
from minisgl.server.engine_client import ChoiceOutput, EngineClient, RequestStream
from minisgl.server.protocol import GenerateRequest
from minisgl.server.sampling import choice_seeds, new_rid, sampling_params
from minisgl.server.streaming import (
    DONE,
    ChoiceResult,
    EventStreamResponse,
    first_batch,
    run_to_completion,
    sse,
    submit,
)


def _request(body: GenerateRequest) -> GenerateReq:
    sp = body.sampling_params
    params, grammar_field = sampling_params(sp, sp.logprobs or sp.top_logprobs > 0, sp.top_logprobs)
    return GenerateReq(
        rids=[new_rid()],
        seeds=choice_seeds(sp.seed, 1),
        params=params,
        max_tokens=sp.max_new_tokens,
        text=body.text,
        input_ids=body.input_ids,
        grammar_field=grammar_field,
    )


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
    if body.stream:
        stream = submit(client, [req])  # the request's id is final once submitted
        first = await first_batch(request, stream)
        events = _events(stream, first, req.rids[0], want_lp, want_times)
        return EventStreamResponse(events, stream)
    r = (await run_to_completion(request, client, [req], 1))[0]
    meta = _meta(req.rids[0], r, want_lp, r.token_times if want_times else None)
    return JSONResponse({"text": r.text, "output_ids": r.ids, "meta_info": meta})


async def _events(
    stream: RequestStream,
    first: list[ChoiceOutput],
    rid: str,
    want_lp: bool,
    want_times: bool,
) -> AsyncIterator[bytes]:
    batch, times = first, []
    while True:
        for co in batch:
            times += co.out.token_times
            last = want_times and co.out.finished
            yield sse(
                {
                    "text": co.out.text,
                    "output_ids": co.out.new_ids,
                    "meta_info": _meta(rid, co.out, want_lp, times if last else None),
                }
            )
        if stream.finished:
            break
        batch = await stream.next_batch()
    yield DONE
