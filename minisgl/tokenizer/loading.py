"""Loading the model's tokenizer once and handing it to sibling processes cheaply.

Building a tokenizer from a GGUF file converts its vocabulary (seconds); a saved copy in HF
format loads in a fraction of that, so the tokenizer worker saves one for the detokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from minisgl.weights import load_tokenizer, resolve_source


def load_and_save(
    model: str | None, directory: str | Path, chat_template: str | None = None
) -> Any:
    """The model's tokenizer (with `chat_template` in place of its own, when given), also
    saved in `directory`."""
    tokenizer = load_tokenizer(resolve_source(model))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def load_saved(directory: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))
