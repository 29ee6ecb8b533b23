"""The parent watch of every worker process: a child whose launcher is killed with SIGKILL
removes the server's folder and exits, told by the kernel (Linux's parent-death signal) or, if
that signal cannot reach it, by its own poll of the parent's pid; while the parent lives, the
signal is ignored (Linux also sends it when the thread that started the child exits)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from server.serving_helpers import alive, still_alive

from minisgl.runtime.child import PARENT_DEATH_SIGNAL

# argv: the folder and how the child may learn that its parent died: "signal" (the poll is
# too slow to matter) or "poll" (the signal is blocked). Echoes each line it reads.
CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from minisgl.runtime import child

    if sys.argv[2] == "signal":
        child.PARENT_POLL_S = 3600
    else:
        signal.pthread_sigmask(signal.SIG_BLOCK, [child.PARENT_DEATH_SIGNAL])
    child.watch_parent(os.getppid(), Path(sys.argv[1]))
    print("up", flush=True)
    for line in sys.stdin:
        print(line.strip(), flush=True)
    """
)
# argv: the child's; prints the child's pid, then lives as long as the child (or until killed).
PARENT = textwrap.dedent(
    """
    import subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", *sys.argv[1:]])
    print(child.pid, flush=True)
    sys.exit(child.wait())
    """
)


@dataclass
class Family:
    """A parent process and its watching child, which owns the folder `folder`."""

    parent: subprocess.Popen[str]
    child: psutil.Process
    folder: Path

    @staticmethod
    def start(folder: Path, how: str) -> Family:
        folder.mkdir()
        (folder / "socket").touch()
        argv = [sys.executable, "-c", PARENT, CHILD, str(folder), how]
        parent = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert parent.stdout is not None  # the child writes here too
        child = psutil.Process(int(parent.stdout.readline()))
        assert parent.stdout.readline() == "up\n"  # it watches
        return Family(parent, child, folder)

    def echo(self, text: str) -> str:
        """What the child answers to `text` (its stdin is the parent's, which does not read)."""
        assert self.parent.stdin is not None and self.parent.stdout is not None
        self.parent.stdin.write(text + "\n")
        self.parent.stdin.flush()
        return self.parent.stdout.readline().strip()

    def kill_parent(self) -> None:
        self.parent.kill()
        self.parent.wait()

    def close(self) -> None:
        for p in (self.parent, self.child):
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                p.kill()


LINUX_ONLY = pytest.mark.skipif(
    sys.platform != "linux", reason="the parent-death signal is Linux's"
)


@pytest.mark.parametrize("how", [pytest.param("signal", marks=LINUX_ONLY), "poll"])
def test_a_child_of_a_killed_parent_removes_the_folder_and_exits(tmp_path: Path, how: str) -> None:
    family = Family.start(tmp_path / "minisgl-x", how)
    try:
        family.kill_parent()
        assert still_alive([family.child], 30) == [], "the orphan did not exit"
        assert not family.folder.exists()
    finally:
        family.close()


@LINUX_ONLY
def test_the_signal_alone_is_ignored_while_the_parent_lives(tmp_path: Path) -> None:
    family = Family.start(tmp_path / "minisgl-x", "signal")
    try:
        family.child.send_signal(PARENT_DEATH_SIGNAL)
        assert family.echo("still here") == "still here"  # it ran the handler and went on
        assert alive(family.child) and (family.folder / "socket").exists()
        family.kill_parent()
        assert still_alive([family.child], 30) == []
    finally:
        family.close()
