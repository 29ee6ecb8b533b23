"""The FastAPI application: routes, authentication, the names it serves, the link to the engine
processes and the gate that closes on shutdown.

The names a server answers to (`--served-model-name`): a request naming a model this server
does not serve gets OpenAI's 404 `model_not_found`, as vLLM answers. A request without `model`,
and one naming `default`, take the first served name: `default` stays an alias so that clients
written for the server's earlier answers keep working."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from minisgl import __version__
from minisgl.config import ChatConfig
from minisgl.config.server import DEFAULT_SHUTDOWN_TIMEOUT_S
from minisgl.message import EngineInfo
from minisgl.message.transport import IpcPaths
from minisgl.server import native_api, openai_api
from minisgl.server import responses as openai_responses
from minisgl.server.engine_client import EngineClient
from minisgl.server.errors import ApiError, error_body, install_error_handlers
from minisgl.server.limits import Limits
from minisgl.server.metrics import Metrics
from minisgl.server.openapi import (
    ChatCompletion,
    Completion,
    Detokenized,
    Generated,
    ModelCard,
    ModelList,
    ResponseObject,
    Status,
    Tokenized,
    Version,
    openapi_schema,
    responses,
)
from minisgl.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    ResponsesRequest,
)
from minisgl.server.shutdown import Gate, GateMiddleware, drain

logger = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 60.0  # the scheduler answers between two steps


@dataclass
class ServerState:
    info: EngineInfo
    ipc: IpcPaths
    api_key: str | None = field(default=None, repr=False)
    limits: Limits = field(default_factory=Limits)
    # How long requests in flight may take to finish once shutdown begins.
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    metrics: Metrics | None = None
    client: EngineClient | None = None
    gate: Gate = field(default_factory=Gate)
    chat: ChatConfig = field(default_factory=ChatConfig)
    index: int = 0  # this API server process's, of `ipc.num_apis`
    queued: Any = None  # the sequences queued server-wide (`EngineClient`)
    # `--served-model-name`: the names requests may give as `model`; empty: the model's own.
    served_model_names: tuple[str, ...] = ()
    # The tokenizer worker's saved tokenizer, for /tokenize and /detokenize (None: no routes).
    tokenizer_dir: Path | None = None


FORM = b"application/x-www-form-urlencoded"


class FormAsJson:
    """Bodies sent as a form read as JSON: `curl -d '{...}'` labels its JSON
    `application/x-www-form-urlencoded` unless told otherwise, and no route of this API takes a
    form, so such a body is read as the JSON it is (as llama.cpp's server does)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = scope["headers"]
            if any(k == b"content-type" and v.startswith(FORM) for k, v in headers):
                headers = [(k, v) for k, v in headers if k != b"content-type"]
                scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


DEFAULT_ALIAS = "default"


@dataclass(frozen=True)
class ServedModels:
    names: tuple[str, ...]  # the first is the id of answers to requests that name none
    max_context: int
    created: int

    def check(self, requested: str | None) -> str:
        """The name an answer carries: the one asked for, or the first served name for none
        and `default`. Any other name raises the 404 `model_not_found`."""
        if requested in self.names:
            assert requested is not None
            return requested
        if requested is None or requested == DEFAULT_ALIAS:
            return self.names[0]
        raise ApiError(
            404,
            f"The model `{requested}` does not exist; this server serves "
            f"{', '.join(repr(n) for n in self.names)} (`{DEFAULT_ALIAS}` names the first)",
            "model",
            code="model_not_found",
        )

    def card(self, name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "minisgl",
            "max_model_len": self.max_context,
        }


class BearerAuth:
    """Every path but /health needs `Authorization: Bearer <key>`."""

    OPEN_PATHS = frozenset({"/health"})

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self._expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if secrets.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        response = ApiError(
            401,
            "missing or wrong API key: send `Authorization: Bearer "
            "<key>` with the key the server was started with",
            code="invalid_api_key",
        ).response()
        await response(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    metrics = state.metrics = state.metrics or Metrics()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        client = state.client = EngineClient(
            state.ipc, metrics, state.info, state.limits, state.index, state.queued
        )
        client.start()
        try:
            yield
        finally:
            await client.stop()

    # A body without Content-Type is read as JSON (curl and scripts often send none).
    app = FastAPI(
        title="minisgl", version=__version__, lifespan=lifespan, strict_content_type=False
    )
    install_error_handlers(app)
    if state.api_key is not None:
        app.add_middleware(BearerAuth, key=state.api_key)
    app.add_middleware(FormAsJson)  # curl -d's JSON
    # Outermost: while shutting down nothing new gets in, nor a body too large.
    app.add_middleware(GateMiddleware, gate=state.gate, max_bytes=state.limits.max_request_bytes)
    _add_routes(app, state, metrics)
    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]
    return app


async def drain_requests(state: ServerState) -> None:
    """Once shutdown begins: refuse new requests, let those in flight finish for up to
    `state.shutdown_timeout` seconds, then answer the rest with 503."""
    await drain(state.gate, _client(state), state.shutdown_timeout)


def _client(state: ServerState) -> EngineClient:
    assert state.client is not None, "the app's lifespan creates the client"
    return state.client


def _get_and_head(app: FastAPI, path: str, endpoint: Callable[..., Any], **kw: Any) -> None:
    """A GET route and its HEAD twin (the same answer without the body; uvicorn drops it)."""
    app.add_api_route(path, endpoint, methods=["GET"], **kw)
    app.add_api_route(path, endpoint, methods=["HEAD"], **kw)


def _add_routes(app: FastAPI, state: ServerState, metrics: Metrics) -> None:
    served = ServedModels(
        state.served_model_names or (state.info.model_name,),
        state.info.max_context,
        int(time.time()),
    )
    # The tool-call format: the flag's, or the one the tokenizer worker detected.
    chat = replace(
        state.chat, tool_call_parser=state.chat.tool_call_parser or state.info.tool_call_parser
    )
    auth = (401,) if state.api_key is not None else ()
    got = (*auth, 503)  # what every GET route can answer besides 200 (503: shutting down)
    posted = (*got, 400, 408, 413)  # what every POST route can answer besides 200
    modeled = (*posted, 404)  # ... and those that name a `model`

    @app.post("/v1/chat/completions", responses=responses(ChatCompletion, *modeled, stream=True))
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        model = served.check(body.model)
        return await openai_api.chat_completions(request, body, _client(state), model, chat)

    @app.post("/v1/responses", responses=responses(ResponseObject, *modeled, stream=True))
    async def create_response(request: Request, body: ResponsesRequest) -> Response:
        """The Responses API, stateless (`store` only false)."""
        model = served.check(body.model)
        return await openai_responses.create_response(request, body, _client(state), model, chat)

    @app.post("/v1/completions", responses=responses(Completion, *modeled, stream=True))
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await openai_api.completions(request, body, _client(state), served.check(body.model))

    @app.post("/generate", responses=responses(Generated, *posted, stream=True))
    async def generate(request: Request, body: GenerateRequest) -> Response:
        return await native_api.generate(request, body, _client(state))

    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [served.card(n) for n in served.names]})

    async def model_card(model_id: str) -> JSONResponse:
        """One model (the SDK's `models.retrieve`); ids may hold slashes."""
        return JSONResponse(served.card(served.check(model_id)))

    _get_and_head(app, "/v1/models", models, responses=responses(ModelList, *got))
    path = "/v1/models/{model_id:path}"
    _get_and_head(app, path, model_card, responses=responses(ModelCard, *got, 404))
    if state.tokenizer_dir is not None:
        _add_tokenizer_routes(app, native_api.TokenizerHost(state.tokenizer_dir), served, got)

    @app.post("/flush_cache", responses=responses(Status, *posted))
    async def flush_cache() -> JSONResponse:
        """Drop the prefix cache's unused entries (benchmarks start cold with it). Refused
        with 400 while requests are in flight: they hold cache pages."""
        try:
            in_flight = await asyncio.wait_for(_client(state).flush_cache(), FLUSH_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ApiError(503, f"the scheduler did not answer in {FLUSH_TIMEOUT_S} s") from None
        if in_flight:
            raise ApiError(
                400, f"the prefix cache was not flushed: requests in flight: {in_flight}"
            )
        return JSONResponse({"status": "flushed"})

    async def health() -> JSONResponse:
        reason = _client(state).failure
        if reason is not None:
            return JSONResponse(error_body(503, reason), status_code=503)
        return JSONResponse({"status": "ok"})

    _get_and_head(app, "/health", health, responses=responses(Status, 503))

    async def prometheus() -> Response:
        metrics.queued_seqs.set(_client(state).num_queued_seqs)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    _get_and_head(
        app,
        "/metrics",
        prometheus,
        response_class=PlainTextResponse,
        responses=responses(None, *got),
    )


def _add_tokenizer_routes(
    app: FastAPI, host: native_api.TokenizerHost, served: ServedModels, got: tuple[int, ...]
) -> None:
    """`got`: the error codes of a GET route."""
    posted = (*got, 400, 404, 408, 413)

    @app.post("/tokenize", responses=responses(Tokenized, *posted))
    async def tokenize(body: native_api.TokenizeRequest) -> JSONResponse:
        served.check(body.model)
        return JSONResponse(await native_api.tokenized(host, body, served.max_context))

    @app.post("/detokenize", responses=responses(Detokenized, *posted))
    async def detokenize(body: native_api.DetokenizeRequest) -> JSONResponse:
        served.check(body.model)
        text = await host.run(lambda tok: native_api.detokenize(tok, body.tokens))
        return JSONResponse({"prompt": text})

    @app.get("/version", responses=responses(Version, *got))
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})
