"""What one engine step produces, the device-side pieces it is built from, and how they get
there from the host."""

from __future__ import annotations

import array
import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from minisgl.attention import AttentionInputs
from minisgl.core import Batch
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


# Python's array module packs a list of numbers about 3.5x faster than torch.tensor(list)
# (8,000 ints: 0.15 ms against 0.56 ms).
_ARRAY_TYPECODES = {torch.int64: "q", torch.float32: "f"}


def host_tensor(values: list, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host list as a CPU tensor (in pinned memory when `pin`, for copies that don't wait)."""
    code = _ARRAY_TYPECODES.get(dtype)
    if code is None or not values:
        host = torch.tensor(values, dtype=dtype)
    else:
        host = torch.frombuffer(array.array(code, values), dtype=dtype)
    return host.pin_memory() if pin else host


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor without a host sync (through pinned memory on CUDA)."""
    host = host_tensor(values, dtype, pin=device.type == "cuda")
    return host.to(device, non_blocking=True)


def step_inputs(
    slots: list[int], prefix: list[int], ext: list[int], device: torch.device
) -> StepInputs:
    """The device inputs of an eager step (rows: request slot, tokens already in KV, new
    tokens), from one host-to-device copy of every per-request number of the step;
    per-token numbers are built on the device."""
    b, t = len(slots), sum(ext)
    seq_lens_host = [p + e for p, e in zip(prefix, ext)]
    cu = [0, *itertools.accumulate(ext)]
    decode = t == b
    # New token i of request r is step row cu[r] + i at position prefix[r] + i: its row
    # plus shift[r]. (A host list of T positions cost 0.7 ms at T = 8,000: building it
    # and converting it to a tensor.) In a decode step the shift is the position.
    shift = prefix if decode else [p - c for p, c in zip(prefix, cu)]
    # Shifts first: in a decode step they are the positions, which the fused RoPE kernel
    # reads, and Triton compiles a kernel per pointer alignment (the buffer's start is
    # aligned; an offset of 8 * k bytes is not for odd k).
    host = shift + slots + seq_lens_host + prefix + ext + cu
    packed = to_device(host, torch.int64, device)
    per_req, seq_lens, prefix_t, ext_t, cu_t = packed.split([2 * b, b, b, b, b + 1])
    req_slots = per_req[b:]
    if decode:
        positions, token_slots = per_req[:b], req_slots
    else:
        # [2, T]: the shift and the request slot of each new token's request
        per_token = per_req.view(2, b).repeat_interleave(ext_t, dim=1, output_size=t)
        positions = torch.arange(t, device=device) + per_token[0]
        token_slots = per_token[1]
    inputs = AttentionInputs(
        req_slots=req_slots,
        seq_lens=seq_lens.int(),
        prefix_lens=prefix_t.int(),
        extend_lens=ext_t.int(),
        cu_extend=cu_t.int(),
        out_loc=torch.empty(0, dtype=torch.int64, device=device),
        is_decode=decode,
        seq_lens_host=seq_lens_host,
        extend_lens_host=list(ext),
    )
    return StepInputs(inputs, positions, token_slots, seq_lens, cu_t)


def batch_inputs(batch: Batch, device: torch.device) -> StepInputs:
    """`step_inputs` of a step plan's rows."""
    return step_inputs(batch.slots, batch.prefix_lens, batch.extend_lens, device)
