"""What one engine step produces, and the device-side pieces it is built from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from minisgl.attention import AttentionInputs
from minisgl.engine.host_flag import HostFlag


@dataclass
class ForwardOutput:
    """Tokens sampled by one step, for the rows of the batch whose `sample` flag was set."""

    sample_rows: list[int]  # batch rows that sampled, in order
    tokens: torch.Tensor  # [S] int64 on the device
    tokens_host: torch.Tensor  # [S] int64 on the host (filled once `ready` has fired)
    logprobs_host: torch.Tensor | None
    top_ids_host: torch.Tensor | None
    top_logprobs_host: torch.Tensor | None
    ready: torch.cuda.Event | None  # recorded after the step's last work; None on the CPU
    # Waited for. On the CPU a step counts as completed only then, as if the device were slow:
    # the scheduler's deferred frees run the same way as on a GPU (and the tests see them).
    waited: bool = False
    # A verify step (speculative decoding): tokens each sampling row produced, in row order;
    # `tokens_host` and the log-probs then hold them all, row after row. None: one per row.
    counts: list[int] | None = None

    def wait(self) -> None:
        """Block until the step has completed on the device."""
        if self.ready is not None:
            self.ready.synchronize()
        self.waited = True

    def done(self) -> bool:
        """Whether the step is known to have completed (never blocks)."""
        return self.waited or (self.ready is not None and self.ready.query())


@dataclass
class StepRows:
    """Where the sampled rows of a step live: their hidden states and request-table cells."""

    hidden: torch.Tensor  # [S, hidden] final hidden state of each sampling row's last token
    req_slots: torch.Tensor  # [S] int64
    seq_lens: torch.Tensor  # [S] int64, the sampled token's position in the token table


class TokenMask(NamedTuple):
    """Which tokens the constrained rows of a step may sample (built on the host)."""

    # [S, ceil(V / 32)] int32, a row per sampling row of the step (rows without a constraint
    # are never read and may hold anything): bit j of word w allows token 32 * w + j
    bits: torch.Tensor
    rows: list[int]  # the sampling rows that have a constraint (the others are not touched)
    # Set while `bits` is still being filled on another thread: it is complete once the flag
    # reaches the value (the device waits for that before it copies the mask).
    ready: tuple[HostFlag, int] | None = None

    def to(self, device: torch.device) -> TokenMask:
        """The mask on `device`, copied once it is complete: the stream waits for the flag
        (CUDA), else the host does."""
        if self.ready is not None:
            flag, value = self.ready
            if not flag.device_wait(value, device):
                flag.host_wait(value)
        return TokenMask(self.bits.to(device, non_blocking=True), self.rows)


class StepInputs(NamedTuple):
    """The device inputs of an eager step."""

    attn: AttentionInputs  # `out_loc` still empty
    positions: torch.Tensor  # [T] int64, position of each new token
    token_slots: torch.Tensor  # [T] int64, request slot of each new token
    seq_lens: torch.Tensor  # [B] int64
    cu_extend: torch.Tensor  # [B+1] int64
