"""Prompt-lookup (n-gram) proposals: what followed the last earlier occurrence of the
request's last n tokens in its own prompt and output."""

from __future__ import annotations

from collections.abc import Sequence

from minisgl.spec.base import DraftRow, Proposer

# Only the most recent tokens are searched: a long prompt would otherwise cost a scan per step.
SEARCH_WINDOW = 4096


def ngram_lookup(ids: Sequence[int], n: int, k: int, min_n: int = 1) -> list[int]:
    """Up to `k` tokens following the latest earlier occurrence of the last `m` tokens of
    `ids`, for the largest `min_n <= m <= n` that occurs; [] when none does."""
    tail = list(ids[-SEARCH_WINDOW:])
    size = len(tail)
    for m in range(min(n, size - 1), max(min_n, 1) - 1, -1):
        key = tail[size - m :]
        # Latest match first: the most recent context predicts best. The match may not be the
        # suffix itself (it must have at least one token after it).
        last = key[-1]
        for start in range(size - m - 1, -1, -1):
            if tail[start + m - 1] == last and tail[start : start + m] == key:
                return tail[start + m : start + m + k]
    return []


def ngram_hit(ids: Sequence[int], n: int, min_n: int = 1) -> bool:
    """Whether `ngram_lookup` would propose anything."""
    return bool(ngram_lookup(ids, n, 1, min_n))


class NgramProposer(Proposer):
    """Host proposer; suffixes of `n` tokens down to `min_n` are looked up. A one-token match
    is found in almost any text and rarely predicts the next tokens: the default minimum of
    the engine's config is two."""

    def __init__(self, n: int, min_n: int = 1) -> None:
        self.n, self.min_n = n, min_n

    def propose(self, rows: Sequence[DraftRow]) -> list[list[int]]:
        return [ngram_lookup(r.ids, self.n, r.k, self.min_n) for r in rows]
