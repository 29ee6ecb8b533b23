from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from minisgl.core.batch import Batch, SeqInfo
from minisgl.core.sampling import SamplingParams


def pages_for(tokens: int, page_size: int) -> int:
    """Pages of `page_size` tokens that hold `tokens` tokens."""
    return -(-tokens // page_size)


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS id or a stop token id or string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # the client went away or the request was cancelled


@dataclass(eq=False)
class Req:
    """One generation request as the scheduler tracks it.

    Token bookkeeping: `prompt_ids + output_ids` are the tokens known on the host. Launched
    steps compute KV for the first `num_computed` of them; steps that have completed on the
    device, for the first `num_stored`. `num_sampled` counts tokens sampled by launched steps,
    which runs ahead of `len(output_ids)` by the steps still in flight (overlap mode).
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # resolved seed: params.seed, or drawn by the front end
    arrival: int = 0  # monotone arrival order at the scheduler
    # When the scheduler received it (time.monotonic() of rank 0, which the other tensor-parallel
    # ranks are given); None until then. The priority policy's aging counts from it.
    arrival_time: float | None = None
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    seq: SeqInfo | None = None  # what the engine knows of it, while it holds a table slot
    num_computed: int = 0
    num_stored: int = 0
    num_sampled: int = 0
    # Prefix-cache state: the first `cache_len` tokens' pages belong to the cache and stay
    # locked through `cache_handle`; pages after those are the request's own.
    cache_handle: Any = None
    cache_len: int = 0
    pages: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_retractions: int = 0
    finish_reason: FinishReason | None = None
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # Eos ids that end this request (the model's unless ignore_eos) plus stop_token_ids.
    stop_ids: frozenset[int] = frozenset()
    error: str | None = None  # why it ended without running, or ran into a fault of ours

    @property
    def slot(self) -> int | None:
        """Row in the request table while running."""
        return None if self.seq is None else self.seq.slot

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def seq_len(self) -> int:
        """Tokens the request will hold once every launched step has landed."""
        return self.prompt_len + self.num_sampled

    @property
    def remaining_tokens(self) -> int:
        """Tokens this request may still sample (upper bound)."""
        return self.params.max_tokens - self.num_sampled

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


def plan_step(
    reqs: list[Req],
    extend: list[int],
    sample: list[bool],
    grow: Callable[[Req, int], None],
    writes: Callable[[], dict[str, Any]],
) -> Batch:
    """The plan of a step whose row i computes `extend[i]` tokens of `reqs[i]` (sampling one
    more when `sample[i]`). Each request is grown to its new length by `grow` (which queues
    its page writes) and counted as computed and sampled from then on: the next step may be
    planned before this one's results are in, and must start where it ends. `writes()`, asked
    after the growth: the plan's table writes and other fields (freed pages, drafts, copies)."""
    prefix = [r.num_computed for r in reqs]
    out_index = [r.num_sampled for r in reqs]
    for r, p, e, s in zip(reqs, prefix, extend, sample):
        grow(r, p + e)
        r.num_computed = p + e
        r.num_sampled += int(s)
    seqs = [r.seq for r in reqs]
    assert None not in seqs
    return Batch(seqs, prefix, extend, sample, out_index, **writes())  # type: ignore[arg-type]
