"""The proposer contract of speculative decoding.

A proposer guesses the next tokens of decoding requests; the target model then scores every
guess of every request in one step (`minisgl.spec.verify`) and keeps the longest prefix that
the target's own sampling would have produced, plus one token of its own. Proposals are
deterministic functions of a request's tokens (a point-mass draft distribution), which is what
the acceptance rule in `verify` assumes: the output distribution equals the target's however
bad the guesses are; bad guesses only cost time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple


class DraftRow(NamedTuple):
    """One request to propose for."""

    # Its tokens, prompt then output, for host proposers (two lists: no copy of the context per
    # step); () for device ones.
    prompt: Sequence[int]
    output: Sequence[int]
    slot: int  # its request-table row
    k: int  # propose at most this many tokens (>= 1)
    seq_len: int  # its tokens so far: the drafts go to positions seq_len .. seq_len + k - 1
    rid: str = ""  # its request id (a host proposer may keep per-request state)


class Proposer(ABC):
    """Proposes up to `row.k` tokens to follow each row's tokens.

    Host proposers (`on_device` False) run in the scheduler on the host token lists; the
    scheduler writes their drafts into the plan. Device proposers run in the engine, which
    lends them its model, KV pool and request table for the step: such a proposer may write
    K/V only at positions from the row's last token on (the verify step overwrites them) and
    writes its drafts into the token table after the last token.
    """

    on_device: bool = False

    @abstractmethod
    def propose(self, rows: Sequence[DraftRow]) -> list[list[int]]:
        """Per row, 0 to `row.k` draft tokens (a device proposer always gives `row.k`)."""
