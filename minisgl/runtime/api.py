"""The API server processes (`--api-server-count`): each runs the HTTP app (`minisgl.server`) on
a listening socket of its own on the server's port (SO_REUSEPORT: the kernel spreads the
connections over them, a burst too), with its own pipes to the tokenizer and from the
detokenizer. They count queued sequences together (`--max-queued-seqs` holds server-wide) and
write their metrics where each one's /metrics reads them all (prometheus_client's multiprocess
mode: the launcher points `PROMETHEUS_MULTIPROC_DIR` at a folder before it starts them)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from minisgl.message import EngineInfo
from minisgl.message.transport import IpcPaths
from minisgl.runtime.child import ChildReady, ParentLink, freeze_gc, run_child
from minisgl.server.args import ServerConfig

# Once the drain has answered every request: how long uvicorn may take to close the connections
# before it cancels what still runs (a client that does not read its answer).
CLOSE_GRACE_S = 2


def api_main(
    config: ServerConfig,
    info: EngineInfo,
    ipc: IpcPaths,
    index: int,
    queued: Any,
    tokenizer_dir: Path,
    link: ParentLink,
) -> None:
    """`queued`: a shared `multiprocessing.Value` of the sequences queued server-wide;
    `tokenizer_dir`: the tokenizer worker's saved tokenizer (for /tokenize, /detokenize)."""
    run_child(
        f"api{index}", link, lambda c: _start(config, info, ipc, index, queued, tokenizer_dir, c)
    )


def _start(
    config: ServerConfig,
    info: EngineInfo,
    ipc: IpcPaths,
    index: int,
    queued: Any,
    tokenizer_dir: Path,
    conn: Connection,
) -> Callable[[], None]:
    import uvicorn

    from minisgl.server.app import ServerState, build_app, drain_requests
    from minisgl.server.connection import uvicorn_options
    from minisgl.server.shutdown import GracefulServer

    state = ServerState(
        info,
        ipc,
        api_key=config.api_key,
        limits=config.limits,
        shutdown_timeout=config.shutdown_timeout,
        chat=config.chat,
        index=index,
        queued=queued,
        served_model_names=config.served_model_names,
        tokenizer_dir=tokenizer_dir,
    )
    uv_config = uvicorn.Config(
        build_app(state),
        log_level=config.log_level,
        timeout_graceful_shutdown=CLOSE_GRACE_S,
        **uvicorn_options(config.deadlines),
    )
    # A second SIGTERM (the launcher's second signal, passed on) leaves at once.
    server = GracefulServer(uv_config, lambda: drain_requests(state), _leave)
    listener = listening_socket(config.host, config.port, share=True)
    conn.send(ChildReady())
    freeze_gc()
    return lambda: server.run(sockets=[listener])


def listening_socket(host: str, port: int, share: bool) -> socket.socket:
    """A socket listening on `host:port`; `share`: one of several (SO_REUSEPORT). Raises
    OSError when the port is taken (by anything else, with `share`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048, reuse_port=share)


def _leave(signum: int) -> None:
    os._exit(128 + signum)
