"""Request ids, per-choice seeds and `SamplingParams` from the API's sampling fields."""

from __future__ import annotations

import random
import uuid

from minisgl.core import InvalidRequestError, SamplingParams
from minisgl.server.errors import ApiError
from minisgl.server.protocol import NativeSamplingParams, SamplingFields

MAX_STOPS = 16


def new_rid() -> str:
    return uuid.uuid4().hex


def choice_seeds(seed: int | None, n: int) -> list[int]:
    """Choice i samples with seed + i (wrapped to int64), or with a fresh random seed."""
    if seed is None:
        return [random.getrandbits(63) for _ in range(n)]
    return [(seed + i + 2**63) % 2**64 - 2**63 for i in range(n)]


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop: at most {MAX_STOPS} stop strings, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise ApiError(400, "stop: stop strings must not be empty", "stop")
    return stops


def sampling_params(
    body: SamplingFields | NativeSamplingParams, logprobs: bool, top_logprobs: int
) -> SamplingParams:
    """The body's sampling fields checked by `SamplingParams` (`max_tokens` travels apart,
    since the default depends on the prompt's length)."""
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    try:
        return SamplingParams(
            # The tokenizer sets max_tokens once it knows the prompt's length (and checks
            # min_tokens against it then); until then it only must not be below min_tokens.
            max_tokens=max(1, body.min_tokens),
            temperature=temperature,
            top_p=top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            seed=body.seed,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            skip_special_tokens=body.skip_special_tokens,
            stop=stop_strings(body.stop),
            min_tokens=body.min_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            priority=body.priority,
        )
    except InvalidRequestError as e:
        raise ApiError.from_invalid(e) from e
