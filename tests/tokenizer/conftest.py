from __future__ import annotations

from typing import Any

import pytest

from minisgl.tokenizer.loading import load_and_save


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The real SmolLM2 tokenizer (converted from the embedded GGUF once per session)."""
    return load_and_save(None, tmp_path_factory.mktemp("tokenizer"))
