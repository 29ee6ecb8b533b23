"""Prompts from a ShareGPT-style JSON file for the serving benchmark: a list of records, each
with `conversations` (or `conversation`), a list of turns `{"from": "human"|"gpt", "value":
text}`; the first human turn is the prompt and the reply that follows sets the output length,
as vLLM's and SGLang's serving benchmarks read that file."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

MIN_PROMPT_TOKENS = 4  # shorter prompts say little about serving


def sharegpt_requests(
    path: str | Path,
    n: int,
    seed: int,
    tokenizer: Any,
    output_range: tuple[int, int],
    max_prompt_tokens: int,
) -> tuple[list[list[int]], list[int]]:
    """`n` (prompt token ids, output length) pairs drawn with `seed` from the file's usable
    records (a prompt of `MIN_PROMPT_TOKENS`..`max_prompt_tokens` tokens with a reply); output
    lengths are the reply's tokens, clamped to `output_range`. Raises ValueError when the file
    holds fewer than `n` usable records."""
    records = json.loads(Path(path).read_text())
    if not isinstance(records, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    pairs = []
    for record in records:
        turns = record.get("conversations") or record.get("conversation") or []
        if len(turns) < 2 or turns[0].get("from") != "human":
            continue
        prompt = tokenizer.encode(turns[0]["value"], add_special_tokens=False)
        reply = len(tokenizer.encode(turns[1]["value"], add_special_tokens=False))
        if MIN_PROMPT_TOKENS <= len(prompt) <= max_prompt_tokens and reply > 0:
            pairs.append((list(prompt), min(max(reply, output_range[0]), output_range[1])))
    if len(pairs) < n:
        raise ValueError(f"{path}: {len(pairs)} usable conversations, {n} requests asked for")
    chosen = random.Random(seed).sample(pairs, n)
    return [p for p, _ in chosen], [m for _, m in chosen]
