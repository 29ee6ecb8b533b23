"""ZMQ PUSH/PULL pipes between the server's processes, over ipc:// sockets in one directory.

Each pipe is bound by the one process that reads it and connected to by its writers, so a
writer may start first: ZMQ queues what it sends until the reader binds. Each API server
process reads a pipe of its own; the workers answer each request on the pipe of the process
that sent it, named in the request's id (`own_rid`).
"""

from __future__ import annotations

import atexit
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from minisgl.config.server import MAX_API_SERVERS  # an API process index rides in request ids
from minisgl.message import decode, encode
from minisgl.message.types import DetokOut, FlushCacheOut, RequestError


@dataclass(frozen=True)
class IpcPaths:
    """The address each process reads from (`api`: API server process 0's)."""

    tokenizer: str
    scheduler: str
    detokenizer: str
    api: str
    num_apis: int = 1

    @staticmethod
    def in_dir(directory: str | Path, num_apis: int = 1) -> IpcPaths:
        tok, sched, detok, api = (
            f"ipc://{Path(directory) / n}" for n in ("tok", "sched", "detok", "api")
        )
        return IpcPaths(tok, sched, detok, api, num_apis)

    def api_at(self, index: int) -> str:
        """The address API server process `index` reads from."""
        return self.api if index == 0 else f"{self.api}{index}"


def own_rid(rid: str, index: int) -> str:
    """`rid` (hex digits) marked as a request of API server process `index`."""
    return f"{index:02x}{rid[2:]}"


def rid_owner(rid: str) -> int:
    return int(rid[:2], 16)


def worker_context() -> zmq.Context:
    """A context for a worker process, destroyed (sockets closed, nothing lingering) at exit,
    so that exiting never waits on a peer that is gone."""
    ctx = zmq.Context()
    atexit.register(ctx.destroy, linger=0)
    return ctx


def _socket(ctx: zmq.Context, kind: int, addr: str) -> Any:
    """A PUSH socket connected to `addr`, or a PULL socket bound there (its reader's)."""
    sock = ctx.socket(kind)
    # Unbounded queues: a full queue would block the scheduler loop or drop requests.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PUSH:
        sock.connect(addr)
    else:
        sock.bind(addr)
    return sock


class Sender:
    """The writing end of a pipe. Sends never block (queues are unbounded)."""

    def __init__(self, ctx: zmq.Context, addr: str) -> None:
        self._sock: zmq.Socket = _socket(ctx, zmq.PUSH, addr)

    def send(self, msg: Any) -> None:
        self._sock.send(encode(msg), copy=False)

    def close(self) -> None:
        self._sock.close()


class ApiSenders:
    """The writing ends of every API server process's pipe, behind one `send`: outputs,
    refusals and flush answers go to the process whose request they answer; anything else
    to all of them."""

    def __init__(self, ctx: zmq.Context, ipc: IpcPaths) -> None:
        self._senders = [Sender(ctx, ipc.api_at(k)) for k in range(ipc.num_apis)]

    def send(self, msg: Any) -> None:
        if len(self._senders) == 1:
            self._senders[0].send(msg)
        elif isinstance(msg, DetokOut):  # every process gets the stats
            parts: list[list[Any]] = [[] for _ in self._senders]
            for out in msg.outputs:
                parts[rid_owner(out.rid)].append(out)
            for sender, outputs in zip(self._senders, parts):
                sender.send(DetokOut(outputs, msg.stats))
        elif isinstance(msg, RequestError):
            self._senders[rid_owner(msg.rids[0])].send(msg)
        elif isinstance(msg, FlushCacheOut):
            self._senders[msg.token % MAX_API_SERVERS].send(msg)
        else:
            for sender in self._senders:
                sender.send(msg)

    def close(self) -> None:
        for sender in self._senders:
            sender.close()


# The kernel hands a process's SIGTERM to any of its threads that does not block it (gloo's,
# torch's, ZMQ's own); Python then runs the handler when the main thread next executes
# bytecode, which a recv blocked inside libzmq would not do until a message came. Waiting in
# slices of this length lets the launcher's SIGTERM stop an idle worker.
SIGNAL_CHECK_MS = 100


class Receiver:
    """The reading end of a pipe (blocking, for the worker processes)."""

    def __init__(self, ctx: zmq.Context, addr: str) -> None:
        self._sock: zmq.Socket = _socket(ctx, zmq.PULL, addr)

    def recv(self) -> Any:
        """Wait for the next message (signal handlers still run while it waits)."""
        while not self._sock.poll(SIGNAL_CHECK_MS):
            pass
        return decode(self._sock.recv(copy=True))

    def wait(self, also: int) -> None:
        """Wait until a message arrives or the file descriptor `also` can be read (signal
        handlers still run while it waits); take the messages with `drain`."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(also, zmq.POLLIN)
        while not poller.poll(SIGNAL_CHECK_MS):
            pass

    def drain(self) -> list[Any]:
        """Every message that has arrived, without waiting."""
        out = []
        while True:
            try:
                out.append(decode(self._sock.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return out

    def close(self) -> None:
        self._sock.close()


class AsyncReceiver:
    """The reading end of a pipe for an asyncio event loop (the API server)."""

    def __init__(self, ctx: zmq.asyncio.Context, addr: str) -> None:
        self._sock: zmq.asyncio.Socket = _socket(ctx, zmq.PULL, addr)

    async def recv(self) -> Any:
        return decode(await self._sock.recv())

    def close(self) -> None:
        self._sock.close()
