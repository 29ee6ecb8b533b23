"""Per-request grammar state: which tokens may come next, advanced by each accepted token."""

from __future__ import annotations

from typing import Any

import torch


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask (bit j of word w allows token 32 * w + j)."""
    return -(-vocab_size // 32)


class RequestGrammar:
    """An xgrammar matcher over one request's output tokens.

    `stop_ids` are the request's own stop tokens (EOS unless ignore_eos, stop_token_ids): the
    grammar allows them only where it may end, so a constrained request stops with "stop" only
    once its output is complete.
    """

    def __init__(self, compiled: Any, stop_ids: list[int]) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_ids or None)

    def accept(self, token: int) -> bool:
        """Advance by `token`; False if the grammar does not allow it (then nothing changes)."""
        ok: bool = self._matcher.accept_token(token)
        return ok

    @property
    def terminated(self) -> bool:
        done: bool = self._matcher.is_terminated()
        return done

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of `bitmask` ([N, W] int32, CPU)."""
        if self.terminated:  # only its stop tokens were left, and one came: anything will do
            bitmask[row].fill_(-1)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)


def fill_bitmask(grammars: list[RequestGrammar | None], vocab_size: int) -> torch.Tensor:
    """[len(grammars), W] int32 allowed-token bits, one row per grammar (all bits set where
    None)."""
    out = torch.full((len(grammars), bitmask_width(vocab_size)), -1, dtype=torch.int32)
    for i, g in enumerate(grammars):
        if g is not None:
            g.fill(out, i)
    return out
