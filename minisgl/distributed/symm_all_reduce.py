"""A faster all-reduce for small messages between the GPUs of one node: PyTorch's
symmetric-memory one-shot kernel.

Decode at batch 1 all-reduces a few KB twice per layer, and NCCL spends far longer per call than
moving those bytes takes. One-shot: every rank copies its input into a buffer that each peer GPU
maps over NVLink (P2P), the ranks meet at one barrier, then every rank reads all the buffers and
sums them itself: two small kernels, no proxy thread, and they replay inside CUDA graphs (the
buffers and their peer pointers are fixed once, before any capture).

The copy is a kernel of its own rather than the fused `one_shot_all_reduce_copy_out`: there each
thread copies its share and only the first warp then signals the peers, with no block barrier in
between, so a peer may read a share another warp has not stored yet. Between two kernels, every
store is done before the barrier starts.

Multicast (NVLS, `multimem_*`) is never used: the hosts we run on turn it off, and one-shot over
P2P needs nothing from the fabric but peer access.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from minisgl.config import env

logger = logging.getLogger(__name__)

# The dtypes PyTorch compiles the one-shot kernel for; float16 goes to NCCL.
DTYPES = (torch.bfloat16, torch.float32)
# The kernel moves 16-byte vectors when the size allows, and stores the sums straight into the
# caller's tensor at the buffer's alignment: sizes and offsets in 16-byte steps keep both aligned.
ALIGN = 16
OP = "one_shot_all_reduce_out"


def default_max_bytes(world: int) -> int:
    """Largest message sent one-shot: each rank reads every peer's whole message, so the
    crossover with NCCL's ring falls as ranks are added (vLLM's custom all-reduce draws the
    same line: always one-shot at 2 ranks up to its buffer, much less at 8)."""
    return (1 << 20) if world <= 2 else (256 << 10)


def unavailable_reason(device: torch.device, world: int, nnodes: int) -> str | None:
    """Why the symmetric-memory all-reduce cannot serve this rank, or None if it may try."""
    if env.DISABLE_CUSTOM_ALLREDUCE.get():
        return f"{env.DISABLE_CUSTOM_ALLREDUCE.name} is set"
    if world < 2:
        return "a single rank has nothing to reduce"
    if nnodes > 1:
        return f"the ranks span {nnodes} nodes (peer access reaches one node only)"
    if device.type != "cuda":
        return f"the device is {device.type}, not cuda"
    if not hasattr(torch.ops.symm_mem, OP):
        return f"this torch ({torch.__version__}) has no symm_mem.{OP}"
    me = device.index if device.index is not None else torch.cuda.current_device()
    if world > torch.cuda.device_count():
        return f"{world} ranks but {torch.cuda.device_count()} GPUs visible"
    # Rank r uses GPU r of the node (launch.rank_config): every pair must reach each other.
    blocked = [p for p in range(world) if p != me and not torch.cuda.can_device_access_peer(me, p)]
    if blocked:
        return f"GPU {me} has no peer access to GPU(s) {blocked}"
    return None


class SymmAllReduce:
    """In-place sum over the group of a small bf16/fp32 CUDA tensor (`accepts` says which)."""

    def __init__(self, buffers: dict[torch.dtype, torch.Tensor], group_name: str, max_bytes: int):
        self.buffers = buffers  # dtype -> symmetric [max_bytes / itemsize], rendezvoused
        self.group_name = group_name
        self.max_bytes = max_bytes

    @classmethod
    def allocate(cls, group: Any, device: torch.device, max_bytes: int) -> SymmAllReduce:
        """This rank's buffers (local work only, no collective): raises if it cannot."""
        import torch.distributed._symmetric_memory as symm_mem

        buffers = {
            dtype: symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
            for dtype in DTYPES
        }
        return cls(buffers, group.group_name, max_bytes)

    def rendezvous(self, group: Any) -> None:
        """Map every peer's buffers (a collective over `group`): before any graph capture."""
        import torch.distributed._symmetric_memory as symm_mem

        for buf in self.buffers.values():
            symm_mem.rendezvous(buf, group)

    def accepts(self, x: torch.Tensor) -> bool:
        # Every rank sees the same shapes, so every rank makes the same choice.
        nbytes = x.numel() * x.element_size()
        return (
            x.dtype in self.buffers
            and x.is_cuda
            and 0 < nbytes <= self.max_bytes
            and nbytes % ALIGN == 0
            and (x.storage_offset() * x.element_size()) % ALIGN == 0
            and x.is_contiguous()
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place."""
        flat = x.view(-1)
        buf = self.buffers[x.dtype][: flat.numel()]
        buf.copy_(flat)
        # The kernel's closing barrier holds every rank until all peers have read its buffer,
        # so the next call's copy cannot overwrite what a slower peer still reads.
        torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", self.group_name, flat)
        return x

    def probe(self) -> bool:
        """Sum a known value on every rank (a collective): True when the result is right."""
        rank, world = dist.get_rank(), dist.get_world_size()
        ok = True
        for dtype in self.buffers:
            x = torch.full((256,), float(rank + 1), dtype=dtype, device=self.device)
            ok &= bool((self(x) == world * (world + 1) / 2).all())
        return ok

    @property
    def device(self) -> torch.device:
        return next(iter(self.buffers.values())).device


def init_symm_all_reduce(
    group: Any,
    device: torch.device,
    nnodes: int,
    agree: Callable[[bool], bool],
    max_bytes: int | None = None,
) -> SymmAllReduce | None:
    """The symmetric-memory all-reduce over `group`, or None where NCCL must do.

    Collective: every rank of `group` calls it. `agree(ok)` must return whether `ok` holds on
    every rank (a MIN over a host-side group); every step that one rank might fail alone is
    agreed on before the next collective, so no rank waits in a rendezvous its peers skipped.
    """
    world = dist.get_world_size(group)
    reason = unavailable_reason(device, world, nnodes)
    if not agree(reason is None):
        logger.info("all-reduce: NCCL only (%s)", reason or "a peer rank cannot use symm_mem")
        return None
    size = max_bytes if max_bytes is not None else default_max_bytes(world)
    ar: SymmAllReduce | None = None
    try:
        ar = SymmAllReduce.allocate(group, device, size)
    except Exception as e:
        logger.warning("all-reduce: symmetric memory allocation failed, NCCL only: %s", e)
    if not agree(ar is not None):
        return None
    assert ar is not None
    ok = False
    try:
        ar.rendezvous(group)
        ok = ar.probe()
        if not ok:
            logger.warning("all-reduce: symm_mem one-shot gave a wrong sum, NCCL only")
    except Exception as e:
        logger.warning("all-reduce: symmetric memory rendezvous failed, NCCL only: %s", e)
    if not agree(ok):
        return None
    logger.info(
        "all-reduce: symm_mem one-shot for bf16/fp32 messages <= %d KiB, NCCL above",
        size >> 10,
    )
    return ar
