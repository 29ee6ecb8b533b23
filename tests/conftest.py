from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

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


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The real SmolLM2 tokenizer (converted from the embedded GGUF once per session)."""
    from minisgl.tokenizer.tokenize import load_and_save

    return load_and_save(None, tmp_path_factory.mktemp("tokenizer"))


# Modules that start servers or several engines first: `make test` gives two workers a module
# at a time, in collection order, so the long modules overlap each other rather than leaving one
# worker alone with them at the end. The order within a module is kept.
HEAVY_DIRS = ("server", "distributed", "spec")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def heavy_first(item: pytest.Item) -> int:
        return 0 if Path(str(item.path)).parent.name in HEAVY_DIRS else 1

    items.sort(key=heavy_first)
