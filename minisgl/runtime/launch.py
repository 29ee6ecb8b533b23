"""Start the server's processes, wait until they are ready, watch them, stop them; or, on nodes
1.., only this node's tensor-parallel ranks.

Start order: the scheduler and the tokenizer load in parallel; the detokenizer starts once the
tokenizer has saved a fast-loading copy of the tokenizer; the tokenizer gets the scheduler's
limits (context, pool size) before it reports ready; then this process binds the port and
starts the API server processes (`start_api`), which all accept on it. This process
only watches: a process that dies fails every request (each API process is told), and the
first SIGINT/SIGTERM drains the API processes before the workers stop.

Across several nodes (`--nnodes`), node 0 runs all of the above, and its scheduler process is
rank 0, which hosts the ranks' rendezvous at `--dist-init-addr`; nodes 1.. run `run_node`: only
their tensor-parallel ranks, which take their config from rank 0 and stop when it does.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from types import FrameType
from typing import Any

from minisgl.config import ServerConfig
from minisgl.message import EngineInfo, WorkerDied
from minisgl.message.transport import ApiSenders, IpcPaths, worker_context
from minisgl.runtime.child import (
    ChildFailed,
    ChildProcess,
    ChildReady,
    ParentLink,
    first_exited,
    run_child,
    stop_processes,
)
from minisgl.runtime.ranks import NodeMemory
from minisgl.runtime.ranks import run_node as run_node_ranks
from minisgl.runtime.workers import start_detokenizer, start_scheduler_process, start_tokenizer

logger = logging.getLogger(__name__)


class StartupError(RuntimeError):
    """A worker process failed while loading; the message carries its traceback."""


@dataclass
class Child:
    process: ChildProcess
    conn: Connection  # the launcher's end of the ready handshake
    sentinel: int  # ready to `wait` on once the process has exited

    @property
    def name(self) -> str:
        return self.process.name


class Workers:
    """The tokenizer, scheduler and detokenizer processes of one server."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.tmpdir = Path(tempfile.mkdtemp(prefix="minisgl-"))
        self.ipc = IpcPaths.in_dir(self.tmpdir, config.api_server_count)
        self.tokenizer_dir = self.tmpdir / "tokenizer"  # the tokenizer worker saves it there
        self.children: dict[str, Child] = {}
        self._mp = mp.get_context("spawn")

    def _spawn(self, name: str, start: Callable[..., Callable[[], None]], *args: Any) -> Child:
        """A child process that runs `start(*args, conn)`'s loop (see `run_child`)."""
        parent_conn, child_conn = self._mp.Pipe()
        link = ParentLink(child_conn, os.getpid(), self.config.log_level, self.tmpdir)
        proc = self._mp.Process(
            target=run_child, args=(name, link, start, *args), name=f"minisgl-{name}"
        )
        proc.start()
        child_conn.close()
        logger.info("started the %s process (pid %d)", name, proc.pid)
        child = self.children[name] = Child(ChildProcess(name, proc), parent_conn, proc.sentinel)
        return child

    def start(self) -> EngineInfo:
        """Start every worker and return once all are ready (or raise StartupError)."""
        engine = self.config.engine
        logger.info("the workers' sockets and saved tokenizer: %s", self.tmpdir)
        tokenizer_dir = self.tokenizer_dir
        sched = self._spawn("scheduler", start_scheduler_process, engine, self.ipc)
        tok = self._spawn(
            "tokenizer", start_tokenizer, engine.model, tokenizer_dir, self.ipc, self.config.chat
        )
        self._await_ready(tok)  # the tokenizer is saved
        detok = self._spawn("detokenizer", start_detokenizer, tokenizer_dir, self.ipc)
        info = self._await_ready(sched).payload
        assert isinstance(info, EngineInfo)
        tok.conn.send(info)
        info = self._await_ready(tok).payload  # completed with what only the tokenizer knows
        assert isinstance(info, EngineInfo)
        self._await_ready(detok)
        logger.info("all workers ready")
        return info

    def start_apis(self, info: EngineInfo, port: int) -> list[Child]:
        """Start the API server processes on `port`; return once all listen (or raise
        StartupError)."""
        config = replace(self.config, port=port)
        queued = self._mp.Value("i", 0)  # sequences queued server-wide
        metrics = self.tmpdir / "metrics"
        metrics.mkdir()
        os.environ[METRICS_DIR_ENV] = str(metrics)  # each API process's copy is what counts
        try:
            apis = [
                self._spawn(
                    f"api{k}", start_api, config, info, self.ipc, k, queued, self.tokenizer_dir
                )
                for k in range(config.api_server_count)
            ]
        finally:
            del os.environ[METRICS_DIR_ENV]
        for api in apis:
            self._await_ready(api)
        return apis

    def _await_ready(self, child: Child) -> ChildReady:
        while True:
            ready = wait([child.conn, *(c.sentinel for c in self.children.values())])
            if child.conn in ready:
                try:
                    msg = child.conn.recv()
                except EOFError:  # it exited; its sentinel tells how
                    msg = None
                if isinstance(msg, ChildFailed):
                    raise StartupError(f"the {child.name} process failed to start:\n{msg.error}")
                if isinstance(msg, ChildReady):
                    return msg
            reason = self.failure()
            if reason is not None:
                raise StartupError(reason)

    def failure(self, workers_only: bool = False) -> str | None:
        """Why the server cannot serve (a process exited; `workers_only`: not an API server),
        or None while all run."""
        gone = first_exited(
            c.process
            for c in self.children.values()
            if not (workers_only and c.name.startswith("api"))
        )
        if gone is None:
            return None
        return f"the {gone.name} process exited (exit code {gone.exit_code})"

    def stop(self) -> None:
        """Terminate every worker (SIGTERM, then SIGKILL after a grace period)."""
        stop_processes((c.process for c in self.children.values()), wait_s=0.0)
        shutil.rmtree(self.tmpdir, ignore_errors=True)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
SUPERVISE_PERIOD_S = 0.2
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # where prometheus_client's processes meet


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@contextmanager
def running_workers(config: ServerConfig) -> Iterator[tuple[Workers, EngineInfo]]:
    """Workers started and ready for the body; stopped afterwards, also on SIGTERM."""
    # SIGTERM's default would end this process at once and leave the workers to notice by
    # themselves; as an exception it runs the cleanup below.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    workers = Workers(config)
    try:
        yield workers, workers.start()
    finally:
        # One more signal must not cut the cleanup short (it takes seconds at most).
        previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        workers.stop()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def run_server(config: ServerConfig) -> int:
    """Serve until SIGINT/SIGTERM, then drain (see `minisgl.server.shutdown`) and stop; returns
    the exit code (1: the API processes exited by themselves)."""
    with running_workers(config) as (workers, info):
        port = free_port_of(config.host, config.port)
        apis = workers.start_apis(info, port)
        logger.info(
            "serving %s on http://%s:%d (%d API server processes)",
            info.model_name,
            config.host,
            port,
            len(apis),
        )
        return watch(workers, apis)


def free_port_of(host: str, port: int) -> int:
    """`port`, once sure that nothing listens there (the API processes share it by
    SO_REUSEPORT, which would let them share it with another server of this user too); for 0,
    a free port the system picks."""
    try:
        with listening_socket(host, port, share=False) as probe:
            return int(probe.getsockname()[1])
    except OSError as e:
        raise StartupError(f"cannot listen on {host}:{port}: {e}") from e


def watch(workers: Workers, apis: list[Child]) -> int:
    """Until every API process has exited: the first SIGINT/SIGTERM is passed on to them (each
    drains, then exits), a second stops everything at once; a process that dies meanwhile fails
    every request of every API process."""
    stopping: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if stopping:  # stop the workers, remove their folder, drop what is in flight and leave
            for sig in STOP_SIGNALS:  # a third signal must not cut the cleanup short
                signal.signal(sig, signal.SIG_IGN)
            logger.warning("%s again: exiting at once", signal.Signals(signum).name)
            workers.stop()
            logging.shutdown()
            os._exit(128 + signum)
        stopping.append(signum)
        logger.info(
            "%s: shutting down (a second signal exits at once)", signal.Signals(signum).name
        )
        for api in apis:
            if api.process.exit_code is None:
                api.process.proc.terminate()

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    apis_pipes = ApiSenders(worker_context(), workers.ipc)
    told = False
    while any(a.process.exit_code is None for a in apis):
        live = [c.sentinel for c in workers.children.values() if c.process.exit_code is None]
        wait(live, SUPERVISE_PERIOD_S)
        # While draining, the API processes leave by themselves.
        reason = workers.failure(workers_only=bool(stopping))
        if reason is not None and not told:
            logger.error("%s; failing every request", reason)
            apis_pipes.send(WorkerDied(reason))
            told = True
    return 0 if stopping else 1


def run_node(config: ServerConfig) -> int:
    """Node K > 0: run this node's tensor-parallel ranks until node 0 stops them; returns 0, or
    the first failed rank's exit code. Raises ValueError when the flags do not fit node 0's.
    This node's `--mem-fraction` sizes its own ranks' pools (the ranks use the smallest)."""
    e = config.engine
    assert e.dist_init_addr is not None  # EngineConfig requires it when nnodes > 1
    logger.info(
        "node %d of %d: ranks %d..%d of %d; meeting rank 0 at %s (no HTTP server on this node)",
        e.node_rank,
        e.nnodes,
        e.node_rank * e.ranks_per_node,
        (e.node_rank + 1) * e.ranks_per_node - 1,
        e.tp_size,
        e.dist_init_addr,
    )
    memory = NodeMemory(mem_fraction=e.mem_fraction)
    # As an exception SIGTERM stops the ranks on its way out (they would notice by themselves,
    # half a second later).
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return run_node_ranks(e.dist_init_addr, e.node_rank, e.nnodes, e.tp_size, memory)
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---- API server processes ------------------------------------------------------------------------
# The API server processes (`--api-server-count`): each runs the HTTP app (`minisgl.server`) on
# a listening socket of its own on the server's port (SO_REUSEPORT: the kernel spreads the
# connections over them, a burst too), with its own pipes to the tokenizer and from the
# detokenizer. They count queued sequences together (`--max-queued-seqs` holds server-wide) and
# write their metrics where each one's /metrics reads them all (prometheus_client's multiprocess
# mode: the launcher points `PROMETHEUS_MULTIPROC_DIR` at a folder before it starts them).

# Once the drain has answered every request: how long uvicorn may take to close the connections
# before it cancels what still runs (a client that does not read its answer).
CLOSE_GRACE_S = 2


def start_api(
    config: ServerConfig,
    info: EngineInfo,
    ipc: IpcPaths,
    index: int,
    queued: Any,
    tokenizer_dir: Path,
    conn: Connection,
) -> Callable[[], None]:
    """API server process `index`: `queued` is a shared `multiprocessing.Value` of the
    sequences queued server-wide; `tokenizer_dir` the tokenizer worker's saved tokenizer (for
    /tokenize, /detokenize)."""
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
    return lambda: server.run(sockets=[listener])


def listening_socket(host: str, port: int, share: bool) -> socket.socket:
    """A socket listening on `host:port`; `share`: one of several (SO_REUSEPORT). Raises
    OSError when the port is taken (by anything else, with `share`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048, reuse_port=share)


def _leave(signum: int) -> None:
    os._exit(128 + signum)
