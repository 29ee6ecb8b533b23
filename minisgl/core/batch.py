from __future__ import annotations

import enum
from dataclasses import dataclass, field

from minisgl.core.sampling import SamplingParams


class BatchKind(enum.Enum):
    DECODE = "decode"  # every request adds exactly one token (CUDA-graph friendly)
    MIXED = "mixed"  # at least one request extends by a prefill chunk


@dataclass(frozen=True, eq=False)
class SeqInfo:
    """What the engine knows of a running request: fixed from admission until it lets go of
    its request-table slot (a retracted request gets a new one when it is admitted again)."""

    slot: int  # row of the request table
    params: SamplingParams
    seed: int
    prompt_len: int
    # Token ids that end the request (EOS unless ignore_eos, and stop_token_ids).
    stop_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class TableWrite:
    """`values` go to cells `start .. start + len(values)` of request-table row `slot`."""

    slot: int
    start: int
    values: list[int]


@dataclass(frozen=True)
class PageCopy:
    """Copy KV pages between tiers: `src[i]` of tier `kind[0]` to `dst[i]` of tier `kind[1]`.

    Tiers: "device" (the pool), "host" (pinned host pages), "disk" (page slots of a file).
    """

    kind: tuple[str, str]
    src: list[int]
    dst: list[int]


@dataclass
class Batch:
    """The plan of one engine step: the only thing the scheduler hands the engine.

    Row `i` computes tokens `[prefix_lens[i], prefix_lens[i] + extend_lens[i])` of the request
    in `seqs[i]`; those tokens' ids are in its token row once `token_writes` are applied (or
    were sampled there by an earlier step). When `sample[i]` the step samples the token after
    the last one, the request's output number `out_index[i]` (0-based), and writes it to the
    token row. The engine applies `page_writes` and `token_writes` (in list order, before the
    step's kernels) and, in the KV debug mode, poisons `freed_pages` (pages given back to the
    allocator since the previous plan) so that a step that still read them would see NaNs.
    `page_copies` move KV pages between the device pool and the host / disk tiers, in list
    order, before the step's kernels read the pool (`minisgl.kvcache.tier`); the poison comes
    after them (a page written back is read before it is poisoned).

    Speculative decoding: a row with `draft_lens[i] = d > 0` verifies d draft tokens. It
    computes the request's last token and the d drafts after it (`extend_lens[i] = d + 1`,
    starting at the last token's position) and samples at all d + 1 positions, keeping the
    accepted drafts and one token of the target's (`minisgl.spec.verify`). The drafts are in
    the token row once `token_writes` are applied, or are written there by the engine's
    device proposer. An empty `draft_lens` means no row verifies.
    """

    seqs: list[SeqInfo]
    prefix_lens: list[int]
    extend_lens: list[int]
    sample: list[bool]
    out_index: list[int]
    token_writes: list[TableWrite] = field(default_factory=list)
    page_writes: list[TableWrite] = field(default_factory=list)
    freed_pages: list[int] = field(default_factory=list)
    draft_lens: list[int] = field(default_factory=list)
    page_copies: list[PageCopy] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.seqs)
        assert len(self.prefix_lens) == n and len(self.extend_lens) == n
        assert len(self.sample) == n and len(self.out_index) == n
        assert all(e >= 1 for e in self.extend_lens)
        assert not self.draft_lens or len(self.draft_lens) == n
        for d, e, s in zip(self.draft_lens, self.extend_lens, self.sample):
            assert d == 0 or (e == d + 1 and s), "a verify row extends by its drafts and samples"

    @property
    def speculative(self) -> bool:
        """Whether some row verifies drafts."""
        return any(self.draft_lens)

    @property
    def size(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def kind(self) -> BatchKind:
        return BatchKind.DECODE if all(e == 1 for e in self.extend_lens) else BatchKind.MIXED

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    @property
    def slots(self) -> list[int]:
        return [s.slot for s in self.seqs]
