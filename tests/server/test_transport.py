"""ZMQ pipes between the server's processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from minisgl.core import SamplingParams
from minisgl.message import TokenizedReq
from minisgl.message.transport import Receiver, Sender, worker_context

# A worker idle in `Receiver.recv` whose SIGTERM the kernel hands to another thread (the main
# thread blocks it, as it may happen to with gloo's or torch's threads about).
IDLE_WORKER = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    from minisgl.runtime.child import setup_child
    from minisgl.message.transport import Receiver, worker_context

    setup_child(os.getppid(), "warning", "test")
    threading.Thread(target=lambda: time.sleep(3600), daemon=True).start()
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    inbox = Receiver(worker_context(), sys.argv[1])
    print("ready", flush=True)
    inbox.recv()
    """
)


def test_messages_arrive_in_order(tmp_path: Path) -> None:
    ctx = worker_context()
    addr = f"ipc://{tmp_path / 'pipe'}"
    out = Sender(ctx, addr)  # the writer may connect before the reader binds
    inbox = Receiver(ctx, addr)
    msgs = [TokenizedReq(f"r{i}", [i, i + 1], SamplingParams(), i) for i in range(3)]
    for m in msgs:
        out.send(m)
    assert [inbox.recv() for _ in msgs] == msgs
    assert inbox.drain() == []


def test_sigterm_stops_a_worker_waiting_for_messages(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", IDLE_WORKER, f"ipc://{tmp_path / 'inbox'}"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0  # the handler ran: a clean exit, not a kill
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
