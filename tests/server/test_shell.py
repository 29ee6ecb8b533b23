"""`python -m minisgl --shell` driven through a pipe."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# Each module starts a real server (about 30 s of model loading on a 2-core CPU).
pytestmark = pytest.mark.slow


def test_shell_chats_keeps_history_resets_and_exits() -> None:
    script = (
        "\n".join(
            [
                "What is the capital of France?",
                "/history",
                "/reset",
                "/history",
                "/exit",
                "this line is never read",
            ]
        )
        + "\n"
    )
    p = subprocess.run(
        [sys.executable, "-m", "minisgl", "--shell"],
        input=script,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    answer = out.split(">>> ", 2)[1]
    assert "Paris" in answer
    history = out.split(">>> ", 3)[2]
    assert "user: What is the capital of France?" in history
    assert "assistant: " in history and "Paris" in history
    assert "(conversation cleared)" in out
    assert "(no conversation yet)" in out.split(">>> ", 5)[4]
    assert "never read" not in out
    pids = [
        int(line.rsplit("pid ", 1)[1].strip(") "))
        for line in p.stderr.splitlines()
        if "started the" in line
    ]
    assert len(pids) == 3 and not any(Path(f"/proc/{pid}").exists() for pid in pids)
