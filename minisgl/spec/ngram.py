"""Prompt-lookup (n-gram) proposals: what followed the last earlier occurrence of the
request's last n tokens in its own prompt and output.

Each request has an index of its m-grams (`min_n <= m <= n`) that have a token after them,
each mapped to its latest start, updated with the tokens appended since the last step: a
lookup is a few dictionary reads, not a scan of the context (which cost a decode step of
SmolLM2 on an H200 about 5% at 300 tokens of context, and grows with it).
"""

from __future__ import annotations

from collections.abc import Sequence

from minisgl.spec.base import DraftRow, Proposer


class NgramIndex:
    """The latest start of every m-gram (`min_n <= m <= n`) of a growing token list that has
    a token after it."""

    def __init__(self, n: int, min_n: int) -> None:
        self.n, self.min_n = n, max(1, min_n)
        self.ids: list[int] = []
        self.latest: dict[tuple[int, ...], int] = {}

    def extend(self, new: Sequence[int]) -> None:
        ids, latest = self.ids, self.latest
        for t in new:
            end = len(ids)  # the m-grams ending at end - 1 now have a token after them
            for m in range(self.min_n, min(self.n, end) + 1):
                latest[tuple(ids[end - m : end])] = end - m
            ids.append(t)

    def sync(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Catch up with `prompt + output` (not built: a copy of the context per step), the
        indexed list plus tokens appended since. Rebuilt when the index does not cover the
        prompt, is longer than both, or differs at its last token (a cheap check, not a full
        one)."""
        known, plen = len(self.ids), len(prompt)
        ends_alike = known == plen or output[known - plen - 1 : known - plen] == self.ids[-1:]
        if not plen <= known <= plen + len(output) or not ends_alike or not known:
            self.ids, self.latest = [], {}
            self.extend(prompt)
            known = plen
        self.extend(output[known - plen :])

    def lookup(self, k: int) -> list[int]:
        """Up to `k` tokens following the latest earlier occurrence of the last `m` tokens,
        for the largest `m` that occurs; [] when none does."""
        ids, size = self.ids, len(self.ids)
        for m in range(min(self.n, size - 1), self.min_n - 1, -1):
            start = self.latest.get(tuple(ids[size - m :]))
            if start is not None:
                return ids[start + m : start + m + k]
        return []


class NgramProposer(Proposer):
    """Host proposer; suffixes of `n` tokens down to `min_n` are looked up. A one-token match
    is found in almost any text and rarely predicts the next tokens: the default minimum of
    the engine's config is two."""

    def __init__(self, n: int, min_n: int = 1) -> None:
        self.n, self.min_n = n, min_n
        self._index: dict[str, NgramIndex] = {}

    def _synced(self, rid: str, prompt: Sequence[int], output: Sequence[int]) -> NgramIndex:
        index = self._index.get(rid)
        if index is None:
            index = self._index[rid] = NgramIndex(self.n, self.min_n)
        index.sync(prompt, output)
        return index

    def hit(self, rid: str, prompt: Sequence[int], output: Sequence[int]) -> bool:
        """Whether `propose` would give request `rid`, of tokens `prompt + output`, a draft."""
        return bool(self._synced(rid, prompt, output).lookup(1))

    def propose(self, rows: Sequence[DraftRow]) -> list[list[int]]:
        return [self._synced(r.rid, r.prompt, r.output).lookup(r.k) for r in rows]

    def drop(self, rid: str) -> None:
        self._index.pop(rid, None)
