"""Rendezvous and process groups of the tensor-parallel ranks.

All ranks meet at rank 0's TCPStore (`dist_init_addr`, torch.distributed's own rendezvous), so
ranks on several hosts are no different from ranks on one. What the ranks tell each other
through the store outside the model is the runtime's (`minisgl.runtime.ranks`).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from minisgl.config import EngineConfig
from minisgl.config.engine import split_host_port
from minisgl.distributed.state import TPInfo, reset_tp_info, set_tp_info
from minisgl.distributed.symm_all_reduce import init_symm_all_reduce

logger = logging.getLogger(__name__)

# Collectives inside a step finish in well under this; past it a rank is presumed stuck.
MODEL_TIMEOUT = timedelta(minutes=10)
# Ranks 1..N-1 wait on the control group while rank 0 has nothing to do, possibly for days.
CONTROL_TIMEOUT = timedelta(days=365)
# How long a rank waits on the store (rank 0 for the others to join, they for rank 0's config).
STORE_TIMEOUT_S = 600.0


def host_store(dist_init_addr: str | None) -> dist.Store:
    """Rank 0's store, at `dist_init_addr` or on a free local port when it is None."""
    host, port = split_host_port(dist_init_addr or "127.0.0.1:0")
    timeout = timedelta(seconds=STORE_TIMEOUT_S)
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)


def connect_store(dist_init_addr: str) -> dist.Store:
    host, port = split_host_port(dist_init_addr)
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S))


def store_address(store: dist.Store) -> str:
    assert isinstance(store, dist.TCPStore)
    return f"{store.host}:{store.port}"


def init_groups(config: EngineConfig, store: dist.Store, rank: int) -> Any:
    """Join the model's group (NCCL on CUDA, gloo on the CPU) and return the control group."""
    on_cuda = config.device.startswith("cuda")
    if on_cuda:
        torch.cuda.set_device(config.device)
    dist.init_process_group(
        "nccl" if on_cuda else "gloo",
        store=dist.PrefixStore("minisgl/pg", store),
        rank=rank,
        world_size=config.tp_size,
        timeout=MODEL_TIMEOUT,
    )
    set_tp_info(TPInfo(rank, config.tp_size))
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    if on_cuda:
        fast = init_symm_all_reduce(
            dist.group.WORLD,
            torch.device(config.device),
            config.nnodes,
            lambda ok: agree_on_min(int(ok), control) == 1,
        )
        set_tp_info(TPInfo(rank, config.tp_size, fast))
    return control


def destroy_groups() -> None:
    reset_tp_info()  # first: drops the symmetric buffers while their group still exists
    if dist.is_initialized():
        dist.destroy_process_group()


def agree_on_min(value: int, group: Any) -> int:
    """The smallest `value` over the ranks (e.g. KV pages: each sizes its pool from its own
    free memory, but the schedulers must all count the same pages)."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())
