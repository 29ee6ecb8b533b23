"""What one request may ask of the server, checked before any expensive work: the body's bytes
(before it is read), the prompts' characters (before they are tokenized), the sequences it
asks for, and (in `EngineClient.submit`) the sequences queued server-wide."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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


class BodyLimit:
    """413 for a body over `max_bytes`: before reading any of it when Content-Length announces
    the size, else (chunked bodies) as soon as the bytes read pass the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            e = BodyTooLarge(self.max_bytes)
            await ApiError(413, e.detail, headers=CLOSE).response()(scope, receive, send)
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counting_receive, send)


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
