"""Verification of drafts against the target's distributions (speculative sampling).

Every verified position n of a step has the target's distribution `p_n` (after temperature,
top-k, top-p, min-p, penalties, bias and grammar masks, exactly as the plain sampler builds
it) and, except the last position of each request, the draft token `d_n` that follows it.
Drafts are deterministic (a point-mass draft distribution q = 1 at d_n), so the standard rule
(Leviathan et al., 2023; Chen et al., 2023: accept with probability min(1, p/q), else sample
from norm(max(0, p - q))) becomes: accept d_n with probability p_n(d_n); on rejection sample
from p_n with d_n removed and the rest renormalised. The token at each position then follows
p_n exactly. Greedy rows accept d_n when it is p_n's argmax and otherwise take the argmax.

Randomness comes from the sampler's hashed uniforms u_n[v] of (seed, output index): the accept
test reads u_n[d_n] and the residual's exponential race reads u_n[v] for v != d_n, so the two
are independent; a seeded request draws the same numbers alone or in any batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Verdict(NamedTuple):
    """Per verified position."""

    accept: torch.Tensor  # [N] bool, the draft after this position is accepted
    choice: torch.Tensor  # [N] int64, the token taken here if the draft is rejected (or none)


def rejection_sample(
    probs: torch.Tensor,  # [N, V] fp32, the target's sampling distribution per position
    draft: torch.Tensor,  # [N] int64, the draft after each position (any value where none)
    has_draft: torch.Tensor,  # [N] bool
    uniforms: torch.Tensor,  # [N, V] fp32 in (0, 1)
) -> Verdict:
    """The sampled rows' verdicts (see the module docstring)."""
    d = draft.clamp(min=0, max=probs.shape[1] - 1).unsqueeze(1)  # [N, 1]
    accept = has_draft & (uniforms.gather(1, d).squeeze(1) < probs.gather(1, d).squeeze(1))
    residual = torch.where(has_draft.unsqueeze(1), probs.scatter(1, d, 0.0), probs)
    choice = (residual / -torch.log(uniforms)).argmax(dim=-1)
    return Verdict(accept, choice)


def greedy_verify(logits: torch.Tensor, draft: torch.Tensor, has_draft: torch.Tensor) -> Verdict:
    """logits [N, V] (after the masks) -> the greedy rows' verdicts."""
    best = logits.argmax(dim=-1)
    return Verdict(has_draft & (best == draft), best)


def accepted_tokens(drafts: list[int], accept: list[bool], choice: list[int]) -> list[int]:
    """One request's output of a verify step: its drafts up to the first rejected one, then
    the target's token at that position (or after the last draft when all were accepted).
    `accept` and `choice` hold one entry per verified position (len(drafts) + 1)."""
    n = next((i for i, a in enumerate(accept[: len(drafts)]) if not a), len(drafts))
    return drafts[:n] + [choice[n]]
