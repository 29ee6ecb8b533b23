"""The server's frozen config: the engine's and the chat front end's, where it listens, and
what one request and one connection may take (`python -m minisgl`'s flags build it:
`minisgl.server.args`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl.config.chat import ChatConfig
from minisgl.config.cli import cli_field
from minisgl.config.engine import EngineConfig
from minisgl.core.errors import check_fields, checked

LOG_LEVELS = ("debug", "info", "warning", "error")
# --shutdown-timeout's default: long enough for most answers to finish, short enough for an
# orchestrator's own grace period (Kubernetes waits 30 s before SIGKILL).
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
# HTTP server processes on one port at most: the owner's index rides in each request id.
MAX_API_SERVERS = 256


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server (`minisgl.server.limits` checks them)."""

    max_request_bytes: int = cli_field(
        8 * 2**20,
        "largest request body: 413 once Content-Length announces more, or once a chunked body "
        "passes it (the rest is not read)",
        "request limits",
        ge=1,
    )
    max_seqs_per_request: int = cli_field(
        256,
        "most sequences (prompts x n) one request may ask for; more: 400",
        "request limits",
        ge=1,
    )
    max_queued_seqs: int = cli_field(
        4096,
        "sequences accepted but without their first token yet (waiting to be tokenized, "
        "admitted or prefilled); a request that would pass it gets 503 with Retry-After",
        "request limits",
        ge=1,
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.max_seqs_per_request > self.max_queued_seqs:
            raise ValueError(
                f"max_seqs_per_request: {self.max_seqs_per_request} is more than "
                f"max_queued_seqs ({self.max_queued_seqs}) lets wait; such a request could never "
                "be served"
            )


@dataclass(frozen=True)
class Deadlines:
    """Seconds a connection may take for each step (nginx's `client_header_timeout`,
    `client_body_timeout`, `send_timeout`, `keepalive_timeout`; `minisgl.server.connection`
    keeps them)."""

    header_timeout: float = cli_field(
        60.0,
        "a request's header must arrive whole within this (from the connection or the "
        "request's first byte); else 408",
        "connection time-outs",
        gt=0,
    )
    body_timeout: float = cli_field(
        60.0,
        "a request's body must arrive whole within this after its header; else 408",
        "connection time-outs",
        gt=0,
    )
    send_timeout: float = cli_field(
        60.0,
        "a client that reads nothing for this long while its answer waits to be written (a "
        "full buffer) is dropped; its request is aborted and its KV freed",
        "connection time-outs",
        gt=0,
    )
    keep_alive_timeout: float = cli_field(
        75.0,
        "an idle connection between two requests is closed after this",
        "connection time-outs",
        gt=0,
    )

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    chat: ChatConfig = field(default_factory=ChatConfig)
    host: str = cli_field("127.0.0.1", "address to listen on", "serving")
    port: int = cli_field(1919, "port to listen on", "serving", ge=0, le=65535)
    api_key: str | None = field(default=None, repr=False)  # None: no authentication
    shell: bool = cli_field(
        False, "chat with the model in this terminal instead of serving HTTP", "serving"
    )
    # The names requests may give as `model` (the first is the one answers carry); empty: the
    # model's own name (its directory's or GGUF file's).
    served_model_names: tuple[str, ...] = ()
    log_level: str = cli_field("info", "logging verbosity", "serving", choices=LOG_LEVELS)
    limits: Limits = field(default_factory=Limits)
    deadlines: Deadlines = field(default_factory=Deadlines)
    shutdown_timeout: float = cli_field(
        DEFAULT_SHUTDOWN_TIMEOUT_S,
        "on SIGINT/SIGTERM the server takes no new request (503, /health too) and gives those "
        "in flight this long to finish; the rest get 503 (a stream: an error event, then "
        "[DONE]); a second signal exits at once",
        "serving",
        metavar="SECONDS",
        ge=0,
    )
    # HTTP server processes sharing the port
    api_server_count: int = checked(1, ge=1, le=MAX_API_SERVERS)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.api_key == "":
            raise ValueError("api_key: must not be empty (leave it out to disable authentication)")
        if self.shell and self.engine.node_rank > 0:
            raise ValueError("shell: runs on node 0 only; leave --shell out with --node-rank > 0")

    @property
    def serves_http(self) -> bool:
        """Node 0 takes the requests; the other nodes only run their ranks."""
        return self.engine.node_rank == 0
