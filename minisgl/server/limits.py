"""What one request may ask of the server, checked before any expensive work: the body's bytes
(before it is read, by `shutdown.GateMiddleware`), the prompts' characters (before they are tokenized), the sequences it
asks for, and (in `EngineClient.submit`) the sequences queued server-wide."""

from __future__ import annotations

from starlette.exceptions import HTTPException

from minisgl.config.server import Limits
from minisgl.message import EngineInfo, GenerateReq
from minisgl.server.errors import ApiError
from minisgl.tokenizer.tokenize import resolve_max_tokens

CLOSE = {"Connection": "close"}  # the rest of a refused body is never read


class BodyTooLarge(HTTPException):
    """Raised while the body is read; an HTTPException so that FastAPI's body parsing passes it
    on to the error handlers unchanged."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(
            413,
            f"the request body exceeds the server's limit of {max_bytes} bytes "
            "(--max-request-bytes)",
            headers=CLOSE,
        )


# ---- prompts and sequences -----------------------------------------------------------------


def check_prompts(reqs: list[GenerateReq], info: EngineInfo) -> None:
    """Refuse a prompt too long for the context before anyone tokenizes it: text by its
    characters (no legal prompt has more than the context has tokens times the longest token's
    characters, once the tokenizer has said how long that is), token ids by their count (with
    the tokenizer's own check)."""
    for req in reqs:
        chars = req.prompt_chars
        if info.max_token_chars is not None and chars > info.max_context * info.max_token_chars:
            param = "messages" if req.messages is not None else "prompt"
            raise ApiError(
                400,
                f"{param}: {chars} characters cannot fit the context of {info.max_context} "
                f"tokens (no token of this model is longer than {info.max_token_chars} "
                "characters); shorten the prompt",
                param,
            )
        if req.input_ids is not None:
            resolve_max_tokens(len(req.input_ids), req.max_tokens, info)


def check_seqs(reqs: list[GenerateReq], limits: Limits) -> None:
    num = sum(len(r.rids) for r in reqs)
    if num > limits.max_seqs_per_request:
        raise ApiError(
            400,
            f"n: {len(reqs)} prompts x n = {num} sequences; this server takes at most "
            f"{limits.max_seqs_per_request} per request (--max-seqs-per-request): send fewer "
            "prompts per request or a smaller n",
            "n",
        )
