"""Deadlines on HTTP connections: uvicorn's h11 protocol, which only times out idle keep-alive
connections, plus a deadline on reading each request's header, one on reading its body, and
one on a client that takes nothing of what is written to it.

A connection whose header or body is not complete in time gets `408` (when no answer has
started) and is closed. One whose client has read nothing for the send time-out while an
answer waits to be written (the kernel's buffers and the transport's full) is dropped, which
the app sees as a disconnect: a stream's request is aborted and its KV freed. The subclass
relies on uvicorn's `H11Protocol` internals (`conn`, `cycle`, `transport`,
`on_response_complete`, `timeout_keep_alive_task`): pyproject.toml pins the uvicorn versions
it was checked against.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from minisgl.config.server import Deadlines
from minisgl.server.errors import error_body

logger = logging.getLogger(__name__)


def _timeout_response(what: str, seconds: float) -> bytes:
    body = json.dumps(
        error_body(408, f"the request's {what} did not arrive within {seconds:g} s")
    ).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class DeadlineProtocol(H11Protocol):
    """One connection. Which read deadline runs follows the client's h11 state: IDLE with no
    keep-alive timer armed (a new connection, or bytes of the next request arrived): the
    header's; SEND_BODY: the body's; otherwise none (the request is read; the app may take as
    long as it needs to answer)."""

    deadlines: ClassVar[Deadlines] = Deadlines()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase: str | None = None  # "header" | "body" | None
        self._read_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[arg-type]
        self._follow_client()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_client()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_client()

    def connection_lost(self, exc: Exception | None) -> None:
        self._enter(None)
        self._cancel_write_timer()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._arm_write_timer()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_write_timer()

    # ---- read deadlines ------------------------------------------------------------------

    def _follow_client(self) -> None:
        if self.transport.is_closing():
            self._enter(None)
            return
        state = self.conn.their_state
        if state is h11.IDLE and self.timeout_keep_alive_task is None:
            self._enter("header")
        elif state is h11.SEND_BODY:
            self._enter("body")
        else:
            self._enter(None)

    def _enter(self, phase: str | None) -> None:
        if phase == self._phase:
            return
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        self._phase = phase
        if phase is not None:
            seconds = (
                self.deadlines.header_timeout if phase == "header" else self.deadlines.body_timeout
            )
            self._read_timer = self.loop.call_later(seconds, self._read_timed_out, phase, seconds)

    def _read_timed_out(self, phase: str, seconds: float) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        logger.debug(
            "closing a connection from %s: its %s took over %g s", self.client, phase, seconds
        )
        # A connection that sent no byte of a request is closed quietly, as an idle keep-alive
        # one is: a client that opened it ahead of time may be about to send on it.
        started = phase == "body" or bool(self.conn.trailing_data[0])
        if started and (self.cycle is None or not self.cycle.response_started):
            # Written directly: h11 has no request to answer while the header is incomplete.
            self.transport.write(_timeout_response(phase, seconds))
        self.transport.close()  # the app, if running, sees a disconnect

    # ---- write deadline -------------------------------------------------------------------

    def _cancel_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _arm_write_timer(self) -> None:
        # While writing is paused the app adds nothing, so a smaller buffer means the client
        # read some of it.
        pending = self.transport.get_write_buffer_size()
        self._write_timer = self.loop.call_later(
            self.deadlines.send_timeout, self._write_timed_out, pending
        )

    def _write_timed_out(self, pending_then: int) -> None:
        self._write_timer = None
        if self.transport.is_closing():
            return
        if self.transport.get_write_buffer_size() < pending_then:
            self._arm_write_timer()  # a slow reader, but a reader
            return
        logger.info(
            "dropping the connection from %s: it read nothing for %g s while an answer waited",
            self.client,
            self.deadlines.send_timeout,
        )
        self.transport.abort()  # close() would wait for the buffer to drain, which it never will


def uvicorn_options(deadlines: Deadlines) -> dict[str, Any]:
    """What `uvicorn.run` needs to enforce `deadlines`."""
    return {
        # The protocol class (uvicorn builds one per connection), with these deadlines.
        "http": type("DeadlineProtocol", (DeadlineProtocol,), {"deadlines": deadlines}),
        "timeout_keep_alive": deadlines.keep_alive_timeout,
    }
