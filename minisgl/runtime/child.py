"""What every child process does the same way: its OS name, signals, the parent watch, logging,
and the startup handshake with its launcher over a multiprocessing pipe.

A launcher killed with SIGKILL can neither stop its children nor remove their folder (the
sockets, the saved tokenizer): each child watches its parent, and on noticing it gone removes
the folder and exits, so the last one to leave removes whatever the others left. The kernel
tells a child at once (Linux's parent-death signal); a thread polling the parent's pid covers
the rest (other systems, and a main thread stuck in native code that runs no signal handler).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

EXIT_GRACE_S = 2.0
PARENT_POLL_S = 0.5
# What the kernel sends a child when its parent dies. Not SIGTERM (the launcher's "stop"), and
# acted on only once the parent is gone: Linux sends it when the thread that started the child
# exits, which need not be the parent's last.
PARENT_DEATH_SIGNAL = signal.SIGHUP
_PR_SET_NAME = 15
# What `ps`, `top` and /proc/PID/comm show for each worker (Linux keeps 15 bytes).
WORKER_NAMES = {
    "scheduler": "minisgl:sched",
    "tokenizer": "minisgl:tok",
    "detokenizer": "minisgl:detok",
}
_PR_SET_PDEATHSIG = 1


@dataclass
class ChildReady:
    payload: Any = None


@dataclass
class ChildFailed:
    error: str  # the traceback, for the launcher to show


@dataclass
class ParentLink:
    """What a server worker gets from its launcher besides its own arguments."""

    conn: Connection  # the startup handshake
    parent_pid: int  # watched: the child exits once it is gone
    log_level: str
    folder: Path  # the server's sockets; removed by the child if the launcher dies


def _prctl(option: int, arg: int | bytes) -> None:
    """Linux's prctl(2); elsewhere nothing happens."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(option, arg, 0, 0, 0)


def set_process_name(name: str) -> None:
    """The OS-level name of this process (Linux; elsewhere nothing happens)."""
    _prctl(_PR_SET_NAME, name.encode()[:15])


def ignore_sigint() -> None:
    # Ctrl-C in a terminal signals the whole process group; the launcher alone decides when its
    # children stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def watch_parent(parent_pid: int, folder: Path | None = None) -> None:
    """Exit at once when the parent is gone (a launcher killed with SIGKILL cannot stop its
    children, so they notice and go), removing `folder` first: the parent cannot either.
    Call from the main thread (it sets a signal handler)."""

    def leave_if_orphaned() -> None:
        if os.getppid() == parent_pid:
            return
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        os._exit(1)

    def loop() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            leave_if_orphaned()

    signal.signal(PARENT_DEATH_SIGNAL, lambda signum, frame: leave_if_orphaned())
    _prctl(_PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL))
    leave_if_orphaned()  # the parent may have died before the kernel was asked to tell
    threading.Thread(target=loop, name="minisgl-parent-watch", daemon=True).start()


def _exit(signum: int, frame: FrameType | None) -> None:
    # Leave through the interpreter's normal shutdown, which releases what the process holds;
    # should that stall (a library thread or exit hook that never returns), leave anyway.
    timer = threading.Timer(EXIT_GRACE_S, os._exit, args=(0,))
    timer.daemon = True
    timer.start()
    sys.exit(0)


def setup_child(parent_pid: int, log_level: str, name: str, folder: Path | None = None) -> None:
    """Signals, logging and the parent watch of a server worker process (which removes `folder`
    if the parent dies)."""
    ignore_sigint()
    # The launcher stops its workers with SIGTERM; as an exception it runs their exit hooks.
    signal.signal(signal.SIGTERM, _exit)
    logging.basicConfig(
        level=log_level.upper(), format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s"
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    watch_parent(parent_pid, folder)


def freeze_gc() -> None:
    """Put what start-up made (the model, its graphs, the warm-up's objects) out of the cyclic
    collector's reach, once the serving loop is about to start: a full collection walks every
    tracked object, and a pause of that kind is the likely cause of the one ~220 ms stall of
    every stream that W4 showed on the H200 at saturation, about a second in (not yet measured
    with this in place)."""
    gc.collect()
    gc.freeze()


def run_child(
    name: str, link: ParentLink, start: Callable[..., Callable[[], None]], *args: Any
) -> None:
    """A spawned child's first call: name the process and set it up; then `start(*args,
    link.conn)` loads what it needs (it may talk to the launcher on the pipe) and returns the
    serving loop. A failure before the loop runs is sent to the launcher."""
    set_process_name(WORKER_NAMES.get(name, f"minisgl:{name}"))
    setup_child(link.parent_pid, link.log_level, name, link.folder)
    try:
        loop = start(*args, link.conn)
    except BaseException:
        link.conn.send(ChildFailed(traceback.format_exc()))
        raise
    freeze_gc()
    loop()


# ---- watching and stopping children --------------------------------------------------------------
# Child processes as the runtime sees them, and the one way they are stopped.
#
# The server's workers start through multiprocessing (spawn, with a pipe for the ready handshake)
# and the tensor-parallel ranks as fresh interpreters through subprocess; `ChildProcess` gives
# both one face, so that watching and stopping are written once, here.


TERM_GRACE_S = 5.0  # after SIGTERM, how long a child may take to leave before SIGKILL


@dataclass
class ChildProcess:
    """One started child process (multiprocessing or subprocess), by a name for messages."""

    name: str
    proc: BaseProcess | subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        pid = self.proc.pid
        assert pid is not None  # started
        return pid

    @property
    def exit_code(self) -> int | None:
        """None while it runs."""
        if isinstance(self.proc, subprocess.Popen):
            return self.proc.poll()
        return self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int | None:
        """Its exit code once it has exited, waiting up to `timeout` seconds (None: forever)."""
        if isinstance(self.proc, subprocess.Popen):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        else:
            self.proc.join(timeout)
        return self.exit_code


def first_exited(children: Iterable[ChildProcess]) -> ChildProcess | None:
    """A child that is no longer running, if any."""
    return next((c for c in children if c.exit_code is not None), None)


def stop_processes(
    children: Iterable[ChildProcess], wait_s: float, term_s: float = TERM_GRACE_S
) -> None:
    """Stop every child: wait up to `wait_s` for them to leave by themselves (they were told
    to), then SIGTERM, up to `term_s` more, then SIGKILL. Returns once all have exited."""
    children = list(children)
    _wait_all(children, wait_s)
    for c in children:
        if c.exit_code is None:
            c.proc.terminate()
    _wait_all(children, term_s)
    for c in children:
        if c.exit_code is None:
            logger.warning("%s did not stop in %.0f s; killing it", c.name, term_s)
            c.proc.kill()
            c.wait()


def _wait_all(children: list[ChildProcess], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for c in children:
        c.wait(max(0.0, deadline - time.monotonic()))
