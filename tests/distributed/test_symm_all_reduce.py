"""When the symmetric-memory all-reduce is tried (never on the CPU, across nodes, at one rank, or
when switched off), and that gloo ranks keep to plain torch.distributed. The kernel itself runs
in tests/gpu/test_symm_all_reduce_gpu.py (tests/gpu/allreduce_check.py on two GPUs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minisgl import LLM
from minisgl.config.env import DISABLE_CUSTOM_ALLREDUCE
from minisgl.distributed import get_tp_info
from minisgl.distributed.symm_all_reduce import default_max_bytes, unavailable_reason

SCRIPT = Path(__file__).resolve().parents[1] / "gpu" / "allreduce_check.py"
CUDA = torch.device("cuda", 0)
DISABLE_ENV = DISABLE_CUSTOM_ALLREDUCE.name


def test_switched_off_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert unavailable_reason(CUDA, world=2, nnodes=1) == f"{DISABLE_ENV} is set"


@pytest.mark.parametrize(
    ("device", "world", "nnodes", "why"),
    [
        (CUDA, 1, 1, "a single rank"),
        (CUDA, 4, 2, "span 2 nodes"),
        (torch.device("cpu"), 2, 1, "not cuda"),
    ],
)
def test_not_tried(
    device: torch.device, world: int, nnodes: int, why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    reason = unavailable_reason(device, world, nnodes)
    assert reason is not None and why in reason


def test_one_shot_sizes() -> None:
    # Decode at batch 64 of a 4096-wide model is 512 KB in bf16: one-shot at 2 ranks.
    assert default_max_bytes(2) >= 64 * 4096 * 2
    assert default_max_bytes(8) < default_max_bytes(2)


def test_gloo_ranks_keep_plain_all_reduce(tiny_model_dir) -> None:
    with LLM(str(tiny_model_dir("llama3")), tp_size=2, num_pages=256) as llm:
        assert get_tp_info().size == 2 and get_tp_info().symm_all_reduce is None
        assert llm.generate([[5, 6, 7]], use_tqdm=False)[0]["token_ids"]


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="runs for real in tests/gpu")
def test_check_script_skips_without_two_gpus() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.startswith("SKIP: needs 2 CUDA GPUs")
