"""Layer-skip self-speculation: the target's own first L layers, its final norm and its LM
head, run autoregressively as the draft model.

KV design: the first L layers of the draft are the first L layers of the target, fed the same
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


class LayerSkipProposer(Proposer):
    """Device proposer over an engine-lent `step` (`minisgl.engine.speculative.draft_step`),
    run autoregressively; also the driver of a separate draft model's steps, whose `prepare`
    first brings its own KV up to each row's last token."""

    on_device = True

    def __init__(
        self, step: DraftStep, prepare: Callable[[Sequence[DraftRow]], None] | None = None
    ) -> None:
        self.step = step
        self.prepare = prepare

    def propose(self, rows: Sequence[DraftRow]) -> list[list[int]]:
        if self.prepare is not None:
            self.prepare(rows)
        drafts: list[list[int]] = [[] for _ in rows]
        steps: list[tuple[list[int], torch.Tensor]] = []
        for j in range(max((r.k for r in rows), default=0)):
            live = [i for i, r in enumerate(rows) if r.k > j]
            slots = [rows[i].slot for i in live]
            steps.append((live, self.step(slots, [rows[i].seq_len - 1 + j for i in live])))
        for live, tokens in steps:  # one wait for the device, after every draft step
            for i, t in zip(live, tokens.tolist()):
                drafts[i].append(t)
        return drafts
