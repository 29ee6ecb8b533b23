"""The symmetric-memory one-shot all-reduce equals NCCL, eagerly and in CUDA graphs, on two GPUs
(tests/gpu/allreduce_check.py, which also prints its timings against NCCL)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

SCRIPT = Path(__file__).resolve().parent / "allreduce_check.py"


def test_symm_all_reduce_equals_nccl() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=280)
    print(out.stdout[-4000:])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "PASS all checks" in out.stdout
