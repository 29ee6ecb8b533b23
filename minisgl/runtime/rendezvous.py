"""What the tensor-parallel ranks tell each other outside the model, through rank 0's store
(`minisgl.distributed.group`): rank 0's config, who has joined, why a rank failed."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict

import torch.distributed as dist

from minisgl.config import EngineConfig
from minisgl.distributed import RankFailedError
from minisgl.distributed.group import STORE_TIMEOUT_S

logger = logging.getLogger(__name__)

NODE_COMMAND = "python -m minisgl.runtime.ranks --dist-init-addr HOST:PORT --node-rank K"


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
    store: dist.Store, world: int, health: Callable[[], None], timeout_s: float = STORE_TIMEOUT_S
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
                f"`{NODE_COMMAND}` on every other node"
            )
        time.sleep(0.05)
