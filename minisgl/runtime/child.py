"""What every child process of the server does the same way: signals, parent watch, logging,
and the startup handshake with the launcher over a multiprocessing pipe."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class ChildReady:
    payload: Any = None


@dataclass
class ChildFailed:
    error: str  # the traceback, for the launcher to show


def _watch_parent(parent_pid: int) -> None:
    # A launcher killed with SIGKILL cannot stop its children; they notice and go.
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(1)


EXIT_GRACE_S = 2.0


def _exit(signum: int, frame: FrameType | None) -> None:
    # Leave through the interpreter's normal shutdown, which releases what the process holds;
    # should that stall (a library thread or exit hook that never returns), leave anyway.
    timer = threading.Timer(EXIT_GRACE_S, os._exit, args=(0,))
    timer.daemon = True
    timer.start()
    sys.exit(0)


def setup_child(parent_pid: int, log_level: str, name: str) -> None:
    # Ctrl-C in a terminal signals the whole process group; the launcher alone decides when its
    # children stop (it terminates them with SIGTERM).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit)
    logging.basicConfig(
        level=log_level.upper(), format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s"
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()


def run_child(
    name: str,
    conn: Connection,
    parent_pid: int,
    log_level: str,
    start: Callable[[Connection], Callable[[], None]],
) -> None:
    """Run a child: `start(conn)` loads what it needs (it may talk to the launcher on `conn`)
    and returns the serving loop; a failure before the loop runs is sent to the launcher."""
    setup_child(parent_pid, log_level, name)
    try:
        loop = start(conn)
    except BaseException:
        conn.send(ChildFailed(traceback.format_exc()))
        raise
    loop()
