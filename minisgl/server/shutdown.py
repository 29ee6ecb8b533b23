"""Graceful shutdown: on the first SIGINT/SIGTERM the server stops taking requests (each new one,
/health included, gets 503), lets those in flight finish for up to `--shutdown-timeout`
seconds, then answers the rest (503 JSON, or an error event and `[DONE]` for a stream that has
begun) before uvicorn closes the connections. A second signal leaves at once.

uvicorn's own shutdown cancels the requests still running once its grace period ends, before
the app could answer them (a plain-text 500, or a chunked body cut short); `GracefulServer`
takes the signals over so that the drain runs first and uvicorn's shutdown finds nothing left
in flight. It relies on `uvicorn.Server`'s `handle_exit`, `shutdown` and `should_exit`
(pyproject.toml pins the uvicorn versions it was checked against).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minisgl.server.engine_client import EngineClient
from minisgl.server.errors import ApiError
from minisgl.server.limits import CLOSE, BodyTooLarge

logger = logging.getLogger(__name__)

SHUTTING_DOWN = "the server is shutting down"
# After the drain answered what was left: how long those answers may take to be written.
ANSWER_GRACE_S = 2.0


class Gate:
    """Counts the HTTP requests the app is answering; once closed, refuses new ones."""

    def __init__(self) -> None:
        self.closed = False
        self.live = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.live += 1
        self._idle.clear()

    def leave(self) -> None:
        self.live -= 1
        if self.live == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Whether every request was answered within `timeout_s`."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True


class GateMiddleware:
    """Counts requests through the gate; once it is closed, answers 503 and closes the
    connection (a client holding a keep-alive connection learns to go elsewhere). A body over
    `max_bytes` gets 413 before anything else looks at the request: before any of it is read
    when Content-Length announces the size, else (chunked bodies) as soon as the bytes read
    pass the limit."""

    def __init__(self, app: ASGIApp, gate: Gate, max_bytes: int) -> None:
        self.app = app
        self.gate = gate
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if self.gate.closed:
            refusal = ApiError(503, SHUTTING_DOWN, headers=CLOSE).response()
        elif declared.isdigit() and int(declared) > self.max_bytes:
            refusal = ApiError(413, BodyTooLarge(self.max_bytes).detail, headers=CLOSE).response()
        else:
            self.gate.enter()
            try:
                await self.app(scope, self._counting(receive), send)
            finally:
                self.gate.leave()
            return
        await refusal(scope, receive, send)

    def _counting(self, receive: Receive) -> Receive:
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise BodyTooLarge(self.max_bytes)
            return message

        return counting_receive


async def drain(gate: Gate, client: EngineClient, timeout_s: float) -> None:
    """Close the gate, give the requests in flight `timeout_s` to finish, then end the rest
    through the engine client (each answers `SHUTTING_DOWN` in its own format) and give those
    answers a moment to be written."""
    gate.closed = True
    if gate.live:
        logger.info(
            "shutting down: %d requests in flight, waiting up to %g s (--shutdown-timeout) for "
            "them to finish",
            gate.live,
            timeout_s,
        )
    if await gate.wait_idle(timeout_s):
        return
    logger.warning("shutting down: answering the %d requests still in flight with 503", gate.live)
    client.fail_all(SHUTTING_DOWN)
    if not await gate.wait_idle(ANSWER_GRACE_S):
        logger.warning("shutting down: %d requests did not take their answer", gate.live)


class GracefulServer(uvicorn.Server):
    """uvicorn's server with the signals taken over: the first SIGTERM ends its main loop, and
    its shutdown runs `drain` first; a second one calls `exit_now(signum)`; SIGINT is left to
    the launcher."""

    def __init__(
        self,
        config: uvicorn.Config,
        drain: Callable[[], Awaitable[None]],
        exit_now: Callable[[int], None],
    ) -> None:
        super().__init__(config)
        self._drain = drain
        self._exit_now = exit_now
        self.stop_signal: int | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGINT:
            # Ctrl-C signals the whole process group: the launcher decides, and passes SIGTERM.
            return
        if self.stop_signal is not None:
            self._exit_now(sig)
            return
        logger.info("%s: shutting down (a second signal exits at once)", signal.Signals(sig).name)
        self.stop_signal = sig
        self.should_exit = True  # the main loop sees it within its 0.1 s tick

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self._drain()  # the listening sockets stay open: late clients get 503, not refused
        await super().shutdown(sockets)
