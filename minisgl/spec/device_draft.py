"""Drafts made on the device, a token at a time by a model the engine lends: the layer-skip
self-draft (the target's own first L layers, its final norm and its LM head) or a separate
draft model (`minisgl.engine.draft_model`, which keeps K/V of its own).

The layer-skip draft's KV design: the first L layers of the draft are the first L layers of the target, fed the same
tokens at the same positions, so the target's K/V of those layers for every accepted token is
exactly what the draft would have computed: the draft attends to the target's pool directly
and needs no KV of its own. Its own K/V (for the last accepted token and the drafts) goes to
the request's pool slots at those positions, which the scheduler has given pages for and which
the verify step overwrites with the target's K/V right after; rejected positions are past the
request's new length and are rolled back with it. No second pool, no copy, no separate
bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from minisgl.spec.base import DraftRow, Proposer

# (request slots, positions) -> [B] int64 greedy drafts on the device: one token of each row
# through the draft layers, its K/V stored and the draft written to the token table after it.
DraftStep = Callable[[list[int], list[int]], torch.Tensor]


class DeviceDraftProposer(Proposer):
    """Device proposer over an engine-lent `step` (`minisgl.engine.speculative.draft_step`),
    run autoregressively; also the driver of a separate draft model's steps, whose `prepare`
    first brings its own KV up to each row's last token."""

    on_device = True

    def __init__(
        self, step: DraftStep, prepare: Callable[[Sequence[DraftRow]], None] | None = None
    ) -> None:
        self.step = step
        self.prepare = prepare

    def draft(self, rows: Sequence[DraftRow]) -> list[tuple[list[int], torch.Tensor]]:
        """Launch each row's `k` draft steps (the drafts land in the token table; no wait for
        the device). Returns, per step, the rows it drafted for and their tokens."""
        if self.prepare is not None:
            self.prepare(rows)
        steps: list[tuple[list[int], torch.Tensor]] = []
        for j in range(max((r.k for r in rows), default=0)):
            live = [i for i, r in enumerate(rows) if r.k > j]
            slots = [rows[i].slot for i in live]
            steps.append((live, self.step(slots, [rows[i].seq_len - 1 + j for i in live])))
        return steps

    def propose(self, rows: Sequence[DraftRow]) -> list[list[int]]:
        """`draft`, then the drafts read back to the host (a wait for the device)."""
        drafts: list[list[int]] = [[] for _ in rows]
        for live, tokens in self.draft(rows):
            for i, t in zip(live, tokens.tolist()):
                drafts[i].append(t)
        return drafts
