"""The server's frozen config: the engine's and the chat front end's, where it listens, and
what one request and one connection may take (`python -m minisgl`'s flags build it:
`minisgl.server.args`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl.config.chat import ChatConfig
from minisgl.config.engine import EngineConfig

LOG_LEVELS = ("debug", "info", "warning", "error")
# --shutdown-timeout's default: long enough for most answers to finish, short enough for an
# orchestrator's own grace period (Kubernetes waits 30 s before SIGKILL).
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
# HTTP server processes on one port at most: the owner's index rides in each request id.
MAX_API_SERVERS = 256


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server (`minisgl.server.limits` checks them)."""

    max_request_bytes: int = 8 * 2**20
    max_seqs_per_request: int = 256  # prompts x n
    # Sequences accepted but without their first token yet (waiting to be tokenized, admitted
    # or prefilled); a request that would pass this gets 503 with Retry-After.
    max_queued_seqs: int = 4096

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_seqs_per_request", "max_queued_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
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

    # From the connection (or the request's first byte) to the header's end.
    header_timeout: float = 60.0
    body_timeout: float = 60.0  # from the header's end to the body's end
    # A client that reads nothing this long while an answer waits to be written is dropped.
    send_timeout: float = 60.0
    keep_alive_timeout: float = 75.0  # idle time between two requests on one connection

    def __post_init__(self) -> None:
        for name in ("header_timeout", "body_timeout", "send_timeout", "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0 seconds, got {getattr(self, name)}")


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    chat: ChatConfig = field(default_factory=ChatConfig)
    host: str = "127.0.0.1"
    port: int = 1919
    api_key: str | None = field(default=None, repr=False)  # None: no authentication
    shell: bool = False
    # The names requests may give as `model` (the first is the one answers carry); empty: the
    # model's own name (its directory's or GGUF file's).
    served_model_names: tuple[str, ...] = ()
    log_level: str = "info"
    limits: Limits = field(default_factory=Limits)
    deadlines: Deadlines = field(default_factory=Deadlines)
    # On SIGINT/SIGTERM, how long requests in flight may take to finish before they get 503.
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    api_server_count: int = 1  # HTTP server processes sharing the port

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level: {self.log_level!r} is not one of {LOG_LEVELS}")
        if self.api_key == "":
            raise ValueError("api_key: must not be empty (leave it out to disable authentication)")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout: must be >= 0 seconds, got {self.shutdown_timeout}")
        if not 1 <= self.api_server_count <= MAX_API_SERVERS:
            raise ValueError(
                f"api_server_count: must be in [1, {MAX_API_SERVERS}], got {self.api_server_count}"
            )
        if self.shell and self.engine.node_rank > 0:
            raise ValueError("shell: runs on node 0 only; leave --shell out with --node-rank > 0")

    @property
    def serves_http(self) -> bool:
        """Node 0 takes the requests; the other nodes only run their ranks."""
        return self.engine.node_rank == 0
