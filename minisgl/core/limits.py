"""How many tokens a request may generate: the context and the KV pool bound prompt + output.
The front end (tokenizer) and the scheduler both check requests with this one function."""

from __future__ import annotations

from minisgl.core.errors import InvalidRequestError


def resolve_max_tokens(
    prompt_len: int, max_tokens: int | None, max_context: int, pool_tokens: int
) -> int:
    """`max_tokens` checked against the room the prompt leaves in the context and in a KV pool
    of `pool_tokens` tokens; None becomes all of that room. Raises InvalidRequestError naming
    the field to change."""
    if prompt_len < 1:
        raise InvalidRequestError("prompt: must contain at least one token")
    limit = min(max_context, pool_tokens)
    what = f"the context of {max_context}" if limit == max_context else f"the KV pool's {limit}"
    room = limit - prompt_len
    if room < 1:
        raise InvalidRequestError(
            f"prompt: {prompt_len} tokens do not fit {what} tokens (one more is needed to "
            "generate); shorten the prompt"
        )
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise InvalidRequestError(
            f"max_tokens: {max_tokens} plus the prompt's {prompt_len} tokens exceed {what} "
            f"tokens; ask for at most {room}"
        )
    return max_tokens
