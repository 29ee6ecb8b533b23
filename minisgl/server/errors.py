"""OpenAI-style error bodies for every error the HTTP API answers with."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import Match

from minisgl.core import InvalidRequestError

logger = logging.getLogger(__name__)

# OpenAI's error types; any other status below 500 is an "invalid_request_error".
_TYPES = {401: "authentication_error", 404: "not_found_error", 500: "internal_error",
          503: "service_unavailable"}  # fmt: skip


class ApiError(Exception):
    """An answer other than 2xx; `param` names the request field at fault, `code` is OpenAI's
    machine-readable reason (such as "model_not_found"), or None where OpenAI sends null."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers
        self.code = code

    def response(self) -> JSONResponse:
        body = error_body(self.status, self.message, self.param, self.code)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def error_param(message: str) -> str | None:
    """The field an InvalidRequestError's message names: they start with it ("top_p: must be
    ...")."""
    field, sep, _ = message.partition(":")
    return field if sep and field and " " not in field else None


class ClientDisconnected(Exception):
    """The client went away before its answer was ready (nobody reads the response)."""


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object: `code` a string or null, as OpenAI sends it (the SDK's `e.code`);
    the HTTP status is the response's own."""
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error"),
            "param": param,
            "code": code,
        }
    }


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid value"))
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', msg)}", None
    if not loc and isinstance(first.get("input"), bytes):  # a Content-Type other than JSON's
        return NOT_JSON, None
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return f"{param or 'body'}: {msg}{more}", param


NOT_JSON = (
    "the body must be a JSON object sent with `Content-Type: application/json` (or with none, "
    "or as curl -d's application/x-www-form-urlencoded)"
)


def _method_not_allowed(request: Request) -> JSONResponse:
    """405 with `Allow` listing the methods of every route at this path (Starlette's own lists
    only the first route's, and a GET route's HEAD twin is a route of its own)."""
    allowed: set[str] = set()
    for route in request.app.routes:
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            allowed |= getattr(route, "methods", None) or set()
    allow = ", ".join(sorted(allowed))
    return ApiError(
        405,
        f"{request.method} is not allowed on {request.url.path}; use {allow}",
        headers={"Allow": allow},
    ).response()


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(InvalidRequestError)
    async def _refused(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return ApiError(400, str(exc), error_param(str(exc))).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return ApiError(400, *_validation_message(exc)).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 405:
            return _method_not_allowed(request)
        # The headers carry what the status needs, such as `Connection: close` with a 413.
        return ApiError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, exc: ClientDisconnected) -> JSONResponse:
        return ApiError(499, "client disconnected").response()

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}").response()
