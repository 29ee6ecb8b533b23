"""Rendezvous and process groups of the tensor-parallel ranks.

All ranks meet at rank 0's TCPStore (`dist_init_addr`, torch.distributed's own rendezvous), so
ranks on several hosts are no different from ranks on one. The store also carries what the
ranks tell each other outside the model: rank 0's config, who has joined, why a rank failed.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from minisgl.config import EngineConfig
from minisgl.config.engine import split_host_port
from minisgl.distributed.errors import RankFailedError
from minisgl.distributed.state import TPInfo, reset_tp_info, set_tp_info
from minisgl.distributed.symm_all_reduce import init_symm_all_reduce

logger = logging.getLogger(__name__)

# Collectives inside a step finish in well under this; past it a rank is presumed stuck.
MODEL_TIMEOUT = timedelta(minutes=10)
# Ranks 1..N-1 wait on the control group while rank 0 has nothing to do, possibly for days.
CONTROL_TIMEOUT = timedelta(days=365)
# Rank 0 waits this long for every rank to join (other nodes are started by hand).
JOIN_TIMEOUT_S = 600.0


def host_store(dist_init_addr: str | None) -> dist.Store:
    """Rank 0's store, at `dist_init_addr` or on a free local port when it is None."""
    host, port = split_host_port(dist_init_addr or "127.0.0.1:0")
    timeout = timedelta(seconds=JOIN_TIMEOUT_S)
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)


def connect_store(dist_init_addr: str) -> dist.Store:
    host, port = split_host_port(dist_init_addr)
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=JOIN_TIMEOUT_S))


def store_address(store: dist.Store) -> str:
    assert isinstance(store, dist.TCPStore)
    return f"{store.host}:{store.port}"


def publish_config(store: dist.Store, config: EngineConfig) -> None:
    """Rank 0's config for the other ranks, which start from its address alone and must all
    build the same engine."""
    store.set("minisgl/config", json.dumps(asdict(config)))


def fetch_config(store: dist.Store) -> EngineConfig:
    return EngineConfig(**json.loads(store.get("minisgl/config")))


def mark_joined(store: dist.Store, rank: int) -> None:
    store.set(f"minisgl/joined/{rank}", "1")


def report_failure(store: dist.Store, rank: int, error: BaseException) -> None:
    """Leave the reason a rank stops where rank 0 looks for it."""
    try:
        store.set(f"minisgl/error/{rank}", f"{type(error).__name__}: {error}")
    except Exception:  # the store went away with rank 0: nobody is left to tell
        logger.debug("could not report rank %d's failure", rank)


def failure_of(store: dist.Store, rank: int) -> str | None:
    """The error rank `rank` reported before it stopped, if any."""
    key = f"minisgl/error/{rank}"
    try:
        return store.get(key).decode() if store.check([key]) else None
    except Exception:
        return None


def wait_for_ranks(
    store: dist.Store, world: int, health: Callable[[], None], timeout_s: float = JOIN_TIMEOUT_S
) -> None:
    """Rank 0: return once ranks 1..world-1 have joined; `health` raises if a local one died."""
    keys = [f"minisgl/joined/{r}" for r in range(1, world)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        health()
        if time.monotonic() > deadline:
            missing = [r for r, k in enumerate(keys, start=1) if not store.check([k])]
            raise RankFailedError(
                f"tensor-parallel ranks {missing} did not join within {timeout_s:.0f} s; start "
                "`python -m minisgl.distributed.launch --dist-init-addr HOST:PORT --node-rank K` "
                "on every other node"
            )
        time.sleep(0.05)


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
