from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from minisgl.distributed.symm_all_reduce import SymmAllReduce


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died or cannot be reached; the engine cannot go on."""


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1
    # Small CUDA all-reduces go here instead of NCCL (None: NCCL or gloo for everything).
    symm_all_reduce: SymmAllReduce | None = field(default=None, compare=False, repr=False)


# The one process-wide global: which tensor-parallel rank this process is. Set once at start
# (before the model is built); tests reset it.
_TP = TPInfo()


def get_tp_info() -> TPInfo:
    return _TP


def set_tp_info(info: TPInfo) -> None:
    global _TP
    _TP = info


def reset_tp_info() -> None:
    set_tp_info(TPInfo())


@contextlib.contextmanager
def tp_size_one() -> Iterator[None]:
    """Act as a lone rank inside the block (to learn a model's unsharded shapes), then restore."""
    saved = _TP
    set_tp_info(TPInfo())
    try:
        yield
    finally:
        set_tp_info(saved)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel group, in place; the identity at tp=1. Small CUDA
    messages take the symmetric-memory one-shot kernel when the group set one up."""
    if _TP.size > 1:
        fast = _TP.symm_all_reduce
        if fast is not None and fast.accepts(x):
            return fast(x)
        with _peers_reachable("all-reduce"):
            torch.distributed.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dimension; the identity at tp=1."""
    if _TP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    with _peers_reachable("all-gather"):
        torch.distributed.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


@contextlib.contextmanager
def _peers_reachable(what: str) -> Iterator[None]:
    # gloo reports a peer that died mid-step as a bare socket error; say what it means.
    try:
        yield
    except RuntimeError as e:
        raise RankFailedError(
            f"{what} across {_TP.size} tensor-parallel ranks failed, a rank is likely gone: {e}"
        ) from e
