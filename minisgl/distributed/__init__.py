"""Tensor-parallel rank and size, process groups and the collectives the layers call."""

from minisgl.distributed.state import (
    RankFailedError,
    TPInfo,
    all_gather_last_dim,
    all_reduce,
    get_tp_info,
    reset_tp_info,
    set_tp_info,
    tp_size_one,
)

__all__ = [
    "RankFailedError",
    "TPInfo",
    "all_gather_last_dim",
    "all_reduce",
    "get_tp_info",
    "reset_tp_info",
    "set_tp_info",
    "tp_size_one",
]
