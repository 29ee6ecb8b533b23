"""Child processes as the runtime sees them, and the one way they are stopped.

The server's workers start through multiprocessing (spawn, with a pipe for the ready handshake)
and the tensor-parallel ranks as fresh interpreters through subprocess; `ChildProcess` gives
both one face, so that watching and stopping are written once, here.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

logger = logging.getLogger(__name__)

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

    def terminate(self) -> None:
        self.proc.terminate()

    def kill(self) -> None:
        self.proc.kill()


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
            c.terminate()
    _wait_all(children, term_s)
    for c in children:
        if c.exit_code is None:
            logger.warning("%s did not stop in %.0f s; killing it", c.name, term_s)
            c.kill()
            c.wait()


def _wait_all(children: list[ChildProcess], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for c in children:
        c.wait(max(0.0, deadline - time.monotonic()))
