"""How many prompt tokens the step being planned may compute.

Two limits. The token limit (`token_budget`) is the one chunked prefill always had: decodes and
prefill chunks fill a step up to `max_prefill_tokens` tokens, prefill keeping at least a quarter,
so that steps that prefill have the same token count while prompts wait and the GEMM libraries
see one shape rather than a new one per step (cuBLAS picks an algorithm for each new M, ~0.1 ms
of host time per GEMM on an H200 host).
The time limit comes from the inter-token latency target: while requests decode, a step that
also prefills keeps them waiting for its whole duration, so it may take only the prompt tokens
that the step-time model says fit in the target after the decodes' own cost (Sarathi-Serve's
stall-free batching, OSDI 2024). Under the time limit a chunk that does not finish its prompt
ends on a page boundary, so every chunk's pages can go to the radix cache whole (a later
request sharing the prefix, or this one resumed after a retraction, reuses them).

The time limit applies only when it can be met usefully: with no decodes running, a prompt
prefills at full size (nobody waits on the step); and when the target leaves less than a
minimum chunk (`min_chunk`: a page, 1/32 of `max_prefill_tokens`, two tokens) beside the
decodes, no step that prefills can meet it, so the step is planned by the token limit alone,
exactly as without a target (fewest such steps). The target itself is either given in seconds or, by
default, `AUTO_MULTIPLE` times the predicted time of the decodes alone: the decode step at the
current load.
"""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.scheduler.step_time import StepShape, StepTimeModel

# Default target: a step that prefills may take this many times the decode step it replaces.
# With the model within ~20% this keeps inter-token gaps under 3x the decode period.
AUTO_MULTIPLE = 2.5
MIN_CHUNK_SHARE = 32  # the smallest useful chunk: max_prefill_tokens / this (and a page)


def token_budget(max_prefill_tokens: int, num_decode: int) -> int:
    """Prompt tokens a step with `num_decode` decoding requests may compute (token limit)."""
    return max(max_prefill_tokens - num_decode, -(-max_prefill_tokens // 4))


def min_chunk(max_prefill_tokens: int, page_size: int) -> int:
    """The smallest chunk worth a step that prefills (at least two tokens: a one-token row is
    priced, and run, as a decode row)."""
    share = max_prefill_tokens // MIN_CHUNK_SHARE // page_size * page_size
    return max(2, page_size, share)


@dataclass(frozen=True)
class TimeLimit:
    """The latency target of one step and the model that prices its rows."""

    model: StepTimeModel
    target_s: float


def step_target(model: StepTimeModel, decodes: StepShape, target_s: float | None) -> float:
    """The target in seconds for a step over `decodes`: `target_s`, or (None) the auto rule."""
    if target_s is not None:
        return target_s
    return AUTO_MULTIPLE * model.predict(decodes)


class PrefillBudget:
    """What the step being planned may still add: `size` asks, `take` commits a chunk.

    `decodes`: the step's decode rows. `limit`: the latency target (None: token limit only).
    """

    def __init__(
        self, tokens: int, page_size: int, decodes: StepShape, limit: TimeLimit | None
    ) -> None:
        self.tokens = tokens
        self.page_size = page_size
        self.shape = decodes
        self.limit = limit

    @staticmethod
    def plan(
        max_prefill_tokens: int,
        page_size: int,
        decodes: StepShape,
        model: StepTimeModel | None,
        target_s: float | None,
    ) -> PrefillBudget:
        """The budget of a step over `decodes`. `model` None or not ready, or `target_s` 0:
        no time limit; `target_s` None: the auto target."""
        tokens = token_budget(max_prefill_tokens, decodes.decode_rows)
        limit = None
        if model is not None and model.ready and target_s != 0 and decodes.decode_rows:
            limit = TimeLimit(model, step_target(model, decodes, target_s))
            smallest = min(min_chunk(max_prefill_tokens, page_size), tokens)
            if model.predict(decodes.with_chunk(0, smallest)) > limit.target_s:
                limit = None  # unattainable: plan as without a target
        return PrefillBudget(tokens, page_size, decodes, limit)

    @property
    def exhausted(self) -> bool:
        return self.tokens <= 0 or (
            self.limit is not None and self.size(0, self.page_size + 1) == 0
        )

    def size(self, prefix: int, left: int) -> int:
        """Tokens a row with `prefix` tokens computed and `left` still to compute may add now
        (0: none this step)."""
        n = min(self.tokens, left)
        if self.limit is None or n <= 0:
            return max(0, n)
        n = self._fitting(prefix, n)
        if n < left:  # not the prompt's last chunk: end on a page boundary
            n = (prefix + n) // self.page_size * self.page_size - prefix
        # A one-token row is priced as a decode row, which may cost more than two prompt
        # tokens (the one place the model is not monotone in tokens).
        if n == 1 and not self._fits(prefix, 1):
            return 0
        return max(0, n)

    def take(self, prefix: int, n: int) -> None:
        self.tokens -= n
        self.shape = self.shape.with_chunk(prefix, n)

    def predicted(self) -> float | None:
        """The model's time for the step planned so far (None without a time limit)."""
        return None if self.limit is None else self.limit.model.predict(self.shape)

    def _fitting(self, prefix: int, most: int) -> int:
        """The most tokens, up to `most`, whose chunk keeps the step within the target
        (the model is non-decreasing in tokens: binary search)."""
        if self._fits(prefix, most):
            return most
        lo, hi = 0, most  # fits(lo), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._fits(prefix, mid):
                lo = mid
            else:
                hi = mid
        return lo

    def _fits(self, prefix: int, n: int) -> bool:
        assert self.limit is not None
        return self.limit.model.predict(self.shape.with_chunk(prefix, n)) <= self.limit.target_s
