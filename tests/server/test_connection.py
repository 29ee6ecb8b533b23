"""Connection deadlines of the HTTP server's protocol, on a real uvicorn server in this process
(a small app stands in for the model: the mechanism is the protocol's) and raw sockets."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import uvicorn
from serving_helpers import free_port
from starlette.types import Message, Receive, Scope, Send

from minisgl.server.connection import Deadlines, uvicorn_options

DEADLINES = Deadlines(
    header_timeout=0.5, body_timeout=0.5, send_timeout=0.5, keep_alive_timeout=0.5
)
CHUNK = b"x" * 65536
BIG = b"y" * (2 << 20)  # one write, far more than the (small) kernel buffers take


@dataclass
class App:
    """/slow answers after a second; /big answers 2 MB in one write; /stream sends chunks
    until the client goes away."""

    disconnects: list[str] = field(default_factory=list)
    chunks_sent: int = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/stream":
            await self._stream(receive, send)
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnects.append(scope["path"])
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/slow":
            await asyncio.sleep(1.0)  # longer than every deadline
        if scope["path"] == "/big":
            await _answer(send, BIG)
            return
        await _answer(send, b"%d bytes" % len(body))

    async def _stream(self, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        gone = asyncio.ensure_future(_disconnected(receive))
        while not gone.done():
            await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
            self.chunks_sent += 1
            await asyncio.sleep(0)
        self.disconnects.append("/stream")


async def _disconnected(receive: Receive) -> None:
    message: Message = await receive()
    while message["type"] != "http.disconnect":
        message = await receive()


async def _answer(send: Send, body: bytes) -> None:
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@dataclass
class Running:
    app: App
    port: int

    def connect(self, small_buffers: bool = False) -> socket.socket:
        """With `small_buffers`, the kernel buffers about 150 KB for the connection (a small
        receive buffer, and an Ethernet-sized MSS: loopback's lets the send buffer reach 4 MB)."""
        s = socket.socket()
        if small_buffers:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1400)
        s.connect(("127.0.0.1", self.port))
        return s


@pytest.fixture(scope="module")
def server() -> Iterator[Running]:
    app, port = App(), free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", **uvicorn_options(DEADLINES)
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    yield Running(app, port)
    srv.should_exit = True
    thread.join(10)


def read_until_closed(s: socket.socket, limit: float = 20) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when that was."""
    start, data = time.monotonic(), b""
    s.settimeout(limit)
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - start


def wait_for(condition: Callable[[], bool], limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, "the condition never came true"
        time.sleep(0.02)


HEAD = b"POST /echo HTTP/1.1\r\nHost: t\r\n"


def test_an_unfinished_header_gets_408_at_its_deadline(server: Running) -> None:
    s = server.connect()
    s.sendall(HEAD)  # no blank line: the header never ends
    data, took = read_until_closed(s)
    assert data.startswith(b"HTTP/1.1 408 ") and b'"code": null' in data and b"header" in data
    assert took >= DEADLINES.header_timeout - 0.05


def test_a_connection_that_sends_nothing_is_closed_quietly(server: Running) -> None:
    data, took = read_until_closed(server.connect())
    assert data == b"" and took >= DEADLINES.header_timeout - 0.05


def test_an_unfinished_body_gets_408_and_the_app_sees_a_disconnect(server: Running) -> None:
    before = server.app.disconnects.count("/echo")
    s = server.connect()
    s.sendall(HEAD + b"Content-Length: 1000\r\n\r\n" + b"x" * 12)
    data, took = read_until_closed(s)
    assert data.startswith(b"HTTP/1.1 408 ") and b"body" in data
    assert took >= DEADLINES.body_timeout - 0.05
    wait_for(lambda: server.app.disconnects.count("/echo") == before + 1)


def test_a_trickling_body_is_cut_at_the_deadline(server: Running) -> None:
    s = server.connect()
    s.sendall(HEAD + b"Content-Length: 1000\r\n\r\n")
    start = time.monotonic()
    with pytest.raises(OSError):  # each byte arrives in time, the whole body does not
        while time.monotonic() - start < 10:
            s.sendall(b"x")
            time.sleep(0.05)
    assert time.monotonic() - start < 5


def test_the_app_may_take_longer_than_the_read_deadlines(server: Running) -> None:
    s = server.connect()
    s.sendall(b"POST /slow HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc")
    data, _ = read_until_closed(s)  # the keep-alive time-out closes it after the answer
    assert data.startswith(b"HTTP/1.1 200 ") and data.endswith(b"3 bytes")


def test_keep_alive_serves_several_requests_then_closes_when_idle(server: Running) -> None:
    s = server.connect()
    for i in range(3):
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nhi")
        s.settimeout(10)
        answer = b""
        while not answer.endswith(b"2 bytes"):
            chunk = s.recv(65536)
            assert chunk, f"closed after {i} answers"
            answer += chunk
        time.sleep(DEADLINES.keep_alive_timeout / 2)  # idle, but less than the time-out
    data, took = read_until_closed(s)
    assert data == b"" and took >= DEADLINES.keep_alive_timeout / 2 - 0.05


def test_a_client_that_stops_reading_is_dropped(server: Running) -> None:
    before = server.app.disconnects.count("/stream")
    s = server.connect(small_buffers=True)
    s.sendall(b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n")
    wait_for(lambda: server.app.disconnects.count("/stream") == before + 1)
    sent = server.app.chunks_sent
    time.sleep(0.5)
    assert server.app.chunks_sent == sent  # the app stopped producing
    data, _ = read_until_closed(s)  # what the kernel had buffered for it, then the drop
    assert len(data) < 2**20


def test_a_client_that_reads_keeps_its_stream(server: Running) -> None:
    s = server.connect()
    s.sendall(b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n")
    before = server.app.disconnects.count("/stream")
    received, start = 0, time.monotonic()
    s.settimeout(10)
    while time.monotonic() - start < 3 * DEADLINES.send_timeout:
        received += len(s.recv(1 << 20))
    assert received > 10 * len(CHUNK)
    assert server.app.disconnects.count("/stream") == before  # still streaming
    s.close()


def test_a_slow_reader_of_a_big_answer_is_not_dropped(server: Running) -> None:
    s = server.connect(small_buffers=True)
    s.sendall(b"GET /big HTTP/1.1\r\nHost: t\r\n\r\n")
    received, start = 0, time.monotonic()
    s.settimeout(10)
    while received < len(BIG):
        chunk = s.recv(1 << 20)
        assert chunk, f"dropped after {received} bytes"
        received += len(chunk)
        time.sleep(0.01)  # a slow reader: the whole answer takes many send time-outs
    assert time.monotonic() - start > 2 * DEADLINES.send_timeout
