"""What `/openapi.json` says the server answers: the response bodies, every status code a route
can return with the error body, `text/event-stream` for streams, and no 422 (FastAPI's default
for invalid bodies; this server answers 400)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict

# ---- response bodies (open: fields may be added) -------------------------------------------


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Open):
    message: str
    type: str
    param: str | None
    code: str | None  # OpenAI's reason, such as "model_not_found"; mostly null


class ErrorBody(_Open):
    error: ErrorDetail


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(_Open):
    role: str
    content: str | None


class _Choice(_Open):
    index: int
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatChoice(_Choice):
    message: AssistantMessage


class CompletionChoice(_Choice):
    text: str


class _Answer(_Open):
    id: str
    object: str
    created: int
    model: str
    usage: Usage


class ChatCompletion(_Answer):
    choices: list[ChatChoice]


class Completion(_Answer):
    choices: list[CompletionChoice]


class Generated(_Open):
    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]


class ModelCard(_Open):
    id: str
    object: str
    created: int
    owned_by: str


class ResponseObject(_Open):
    """A Responses API answer: `output` holds message, function_call and reasoning items."""

    id: str
    object: str
    created_at: int
    model: str
    status: str
    output: list[dict[str, Any]]


class ModelList(_Open):
    object: str
    data: list[ModelCard]


class Status(_Open):
    status: str


class Tokenized(_Open):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class Detokenized(_Open):
    prompt: str


class Version(_Open):
    version: str


# ---- status codes --------------------------------------------------------------------------

_WHY = {
    400: (
        "The request is invalid (a JSON schema, regex or grammar that cannot be compiled or "
        "enforced included); `error.param` names the field to change."
    ),
    401: "Missing or wrong API key.",
    408: "The request's header or body did not arrive within the server's time-out.",
    404: "No such model (`error.code` model_not_found): `/v1/models` lists those served.",
    413: "The request body is larger than --max-request-bytes.",
    503: "The engine is unavailable, the server is shutting down, or (with Retry-After) too "
    "many sequences are queued.",
}
# Each server-sent event: `data:` one JSON chunk (an error object if the request fails after
# its stream began), and `[DONE]` last. `itemSchema` describes one event (OpenAPI 3.2, as
# FastAPI and schemathesis read it).
STREAM = {
    "text/event-stream": {
        "itemSchema": {
            "type": "object",
            "required": ["data"],
            "properties": {
                "data": {"type": "string", "contentMediaType": "application/json"},
                "event": {"type": "string"},
            },
        }
    }
}


def responses(
    ok: type[BaseModel] | None, *errors: int, stream: bool = False
) -> dict[int | str, Any]:
    """A route's `responses=`: its 200 body (JSON, or server-sent events when `stream`) and
    the error codes it can answer with."""
    out: dict[int | str, Any] = {
        code: {"model": ErrorBody, "description": _WHY[code]} for code in sorted(errors)
    }
    if ok is not None:
        out[200] = {"model": ok, **({"content": STREAM} if stream else {})}
    return out


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document (built once), without FastAPI's 422 responses."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in doc.get("paths", {}).values():
            for operation in path.values():
                answers = operation.get("responses", {})
                answers.pop("422", None)
                for code, answer in answers.items():
                    _errors_are_json(code, answer)
        schemas = doc.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        app.openapi_schema = doc
    return app.openapi_schema


def _errors_are_json(code: str, answer: dict[str, Any]) -> None:
    # FastAPI files an error's model under the route's own media type (text/plain for
    # /metrics); error bodies are JSON everywhere.
    content = answer.get("content", {})
    if content and code.isdigit() and int(code) >= 400 and "application/json" not in content:
        answer["content"] = {"application/json": next(iter(content.values()))}
