from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# The KV debug mode in every engine the tests build (server processes inherit it): pages given
# back are poisoned with NaN, and a free of anything a step in flight references fails.
os.environ.setdefault("MINISGL_DEBUG_KV", "1")


@pytest.fixture(autouse=True)
def _reset_globals():
    """Each test starts at tp rank 0 of 1 (the only process-wide global)."""
    from minisgl.distributed import reset_tp_info

    reset_tp_info()
    yield
    reset_tp_info()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A factory: tiny_model_dir(arch) -> directory of a saved random HF model (cached)."""
    from helpers import save_tiny_model

    made: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in made:
            made[arch] = save_tiny_model(arch, tmp_path_factory.mktemp(arch))
        return made[arch]

    return make
