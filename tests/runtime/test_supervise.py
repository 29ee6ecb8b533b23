"""The one stop path of the runtime: children started by subprocess and by multiprocessing, one
that leaves when told, one that leaves on SIGTERM, one that ignores SIGTERM and is killed."""

from __future__ import annotations

import multiprocessing as mp
import signal
import subprocess
import sys
import time

from minisgl.runtime.child import ChildProcess, first_exited, stop_processes


def python(code: str) -> ChildProcess:
    """A child interpreter that prints "up" once `code` has run, then sleeps."""
    proc = subprocess.Popen(
        [sys.executable, "-c", f"{code}\nprint('up', flush=True)\nimport time; time.sleep(60)"],
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    return ChildProcess("test child", proc)


def test_stop_terminates_then_kills() -> None:
    polite = python("")
    stubborn = python("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    start = time.monotonic()
    stop_processes([polite, stubborn], wait_s=0.0, term_s=0.5)
    assert polite.exit_code == -signal.SIGTERM
    assert stubborn.exit_code == -signal.SIGKILL
    assert time.monotonic() - start < 5


def test_stop_waits_for_children_that_leave() -> None:
    leaving = ChildProcess(
        "leaving", subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    )
    stop_processes([leaving], wait_s=10.0, term_s=0.5)
    assert leaving.exit_code == 0  # not signalled: it left by itself within wait_s


def test_multiprocessing_children_and_first_exited() -> None:
    ctx = mp.get_context("spawn")
    done = ctx.Process(target=time.sleep, args=(0,))
    running = ctx.Process(target=time.sleep, args=(60,))
    done.start()
    running.start()
    children = [ChildProcess("done", done), ChildProcess("running", running)]
    assert children[0].wait(30) == 0
    assert first_exited(children) is children[0]
    assert first_exited(children[1:]) is None
    stop_processes(children, wait_s=0.0)
    assert children[1].exit_code == -signal.SIGTERM
