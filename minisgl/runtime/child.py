"""What every child process does the same way: its OS name, signals, the parent watch, logging,
and the startup handshake with its launcher over a multiprocessing pipe."""

from __future__ import annotations

import ctypes
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

EXIT_GRACE_S = 2.0
PARENT_POLL_S = 0.5


@dataclass
class ChildReady:
    payload: Any = None


@dataclass
class ChildFailed:
    error: str  # the traceback, for the launcher to show


def set_process_name(name: str) -> None:
    """The OS-level name of this process (Linux; elsewhere nothing happens)."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def named_main(os_name: str, target: Callable[..., None], *args: Any) -> None:
    """A spawned child's first call: name the process, then run `target(*args)`."""
    set_process_name(os_name)
    target(*args)


def ignore_sigint() -> None:
    # Ctrl-C in a terminal signals the whole process group; the launcher alone decides when its
    # children stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def watch_parent(parent_pid: int) -> None:
    """Exit at once when the parent is gone: a launcher killed with SIGKILL cannot stop its
    children, so they notice and go."""

    def loop() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=loop, name="minisgl-parent-watch", daemon=True).start()


def _exit(signum: int, frame: FrameType | None) -> None:
    # Leave through the interpreter's normal shutdown, which releases what the process holds;
    # should that stall (a library thread or exit hook that never returns), leave anyway.
    timer = threading.Timer(EXIT_GRACE_S, os._exit, args=(0,))
    timer.daemon = True
    timer.start()
    sys.exit(0)


def setup_child(parent_pid: int, log_level: str, name: str) -> None:
    """Signals, logging and the parent watch of a server worker process."""
    ignore_sigint()
    # The launcher stops its workers with SIGTERM; as an exception it runs their exit hooks.
    signal.signal(signal.SIGTERM, _exit)
    logging.basicConfig(
        level=log_level.upper(), format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s"
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    watch_parent(parent_pid)


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
