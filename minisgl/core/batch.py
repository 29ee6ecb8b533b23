from __future__ import annotations

import enum
from dataclasses import dataclass

from minisgl.core.req import Req


class BatchKind(enum.Enum):
    DECODE = "decode"  # every request adds exactly one token (CUDA-graph friendly)
    MIXED = "mixed"  # at least one request extends by a prefill chunk


@dataclass
class Batch:
    """The work of one engine step.

    Request `i` computes tokens `[prefix_lens[i], prefix_lens[i] + extend_lens[i])` of its
    sequence; those tokens' ids are already in the request table's token row. When
    `sample[i]` the step samples the token after the last one and writes it to the token row.
    """

    reqs: list[Req]
    prefix_lens: list[int]
    extend_lens: list[int]
    sample: list[bool]

    def __post_init__(self) -> None:
        n = len(self.reqs)
        assert len(self.prefix_lens) == n and len(self.extend_lens) == n and len(self.sample) == n
        assert all(e >= 1 for e in self.extend_lens)

    @property
    def size(self) -> int:
        return len(self.reqs)

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
    def wants_logprobs(self) -> bool:
        return any(r.params.logprobs for r in self.reqs)
