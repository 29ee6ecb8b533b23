"""Start, run and stop tensor-parallel ranks.

Rank 0 lives in the process that takes requests (the offline `LLM`, or the server's scheduler
process) and holds a `TPLaunch`: it hosts the rendezvous, starts the other ranks of its node and
stops them on `close`. Every other rank runs `run_worker` in a process of its own: it builds the
same engine as rank 0 (from rank 0's config, read from the rendezvous store) and steps its own
scheduler in lockstep with rank 0's, fed by the `RequestSync`. On nodes 1..nnodes-1,
`python -m minisgl.distributed.launch --node-rank K` starts the node's ranks and waits for them.

Ranks start as fresh interpreters (`python -m minisgl.distributed.launch --rank R`) rather than
through multiprocessing's spawn, which re-imports the caller's main module: a script that
creates `LLM(tp_size=2)` without an `if __name__ == "__main__"` guard would start itself again.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from minisgl.config import EngineConfig
from minisgl.distributed.errors import EngineStopped, RankFailedError
from minisgl.distributed.group import (
    agree_on_min,
    connect_store,
    destroy_groups,
    failure_of,
    fetch_config,
    host_store,
    init_groups,
    mark_joined,
    publish_config,
    report_failure,
    store_address,
    wait_for_ranks,
)
from minisgl.distributed.sync import RequestSync
from minisgl.engine import Engine
from minisgl.scheduler import Scheduler

logger = logging.getLogger(__name__)

STOP_GRACE_S = 10.0  # how long `close` waits for the ranks to leave before it kills them


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config rank `rank` builds its engine from: on CUDA, GPU `rank % ranks_per_node`."""
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda:"):
        raise ValueError(
            f"device: {device!r} names one GPU but tp_size {config.tp_size} needs one per rank; "
            "pass 'cuda' (rank r uses GPU r % ranks-per-node of its node)"
        )
    if device == "cuda":
        device = f"cuda:{rank % config.ranks_per_node}"
    return replace(config, device=device)


def build_scheduler(config: EngineConfig, rank: int, control: Any, sync: RequestSync) -> Scheduler:
    """This rank's engine and scheduler; every rank counts the same KV pages."""
    engine = Engine(config)
    # Each rank sizes its pool from its own free memory; schedulers that counted different
    # pages would admit different requests and fall out of step.
    engine.num_pages = agree_on_min(engine.num_pages, control)
    return Scheduler(engine, sync=sync)


def run_steps(scheduler: Scheduler) -> None:
    """A worker rank's loop: each step waits for rank 0's news, then runs the same batch."""
    try:
        while True:
            scheduler.step()
    except EngineStopped:
        logger.info("rank 0 stopped the engine")


# ---- ranks 1..N-1 ------------------------------------------------------------------------------


def run_worker(rank: int, dist_init_addr: str, parent_pid: int) -> None:
    """Entry point of tensor-parallel rank `rank` >= 1, in a process of its own."""
    store = connect_store(dist_init_addr)
    try:
        # Rank 0's config: every rank must build the same engine.
        cfg = rank_config(fetch_config(store), rank)
        _setup_worker(rank, cfg, parent_pid)
        mark_joined(store, rank)
        control = init_groups(cfg, store, rank)
        run_steps(build_scheduler(cfg, rank, control, RequestSync(control, rank)))
    except BaseException as e:
        report_failure(store, rank, e)
        raise
    finally:
        destroy_groups()


def _setup_worker(rank: int, config: EngineConfig, parent_pid: int) -> None:
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s tp{rank} %(levelname)s %(name)s: %(message)s"
    )
    # Ctrl-C reaches every process of the terminal's group; rank 0 alone decides when to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not config.device.startswith("cuda"):
        # The node's cores are shared by its ranks; more threads than that only thrash.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.ranks_per_node))
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    # A parent killed outright cannot stop its ranks; they notice and go.
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(1)


def start_ranks(dist_init_addr: str, ranks: Iterable[int]) -> dict[int, subprocess.Popen]:
    """Start `run_worker` for each rank, each in a fresh interpreter."""
    env = dict(os.environ)
    # The ranks import this very minisgl, wherever the caller found it.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "minisgl.distributed.launch", "--dist-init-addr", dist_init_addr]
    return {r: subprocess.Popen([*cmd, "--rank", str(r)], env=env) for r in ranks}


def stop_processes(procs: Iterable[subprocess.Popen], grace_s: float) -> None:
    """Wait up to `grace_s` for the processes to leave, then terminate, then kill."""
    procs = list(procs)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=2.0)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- rank 0 ------------------------------------------------------------------------------------


class TPLaunch:
    """Rank 0's handle on the tensor-parallel group: `start`, `build_scheduler`, `close`."""

    def __init__(self, config: EngineConfig, store: dist.Store) -> None:
        self.config = config
        self.store = store
        self.procs: dict[int, subprocess.Popen] = {}
        self.control: Any = None
        self.sync: RequestSync | None = None
        self._closed = False

    @classmethod
    def start(cls, config: EngineConfig) -> TPLaunch:
        """Host the rendezvous, start this node's other ranks and join the process groups."""
        if config.node_rank != 0:
            raise ValueError(
                f"node_rank: rank 0 runs on node 0, not {config.node_rank}; start the ranks of "
                "node K with `python -m minisgl.distributed.launch --dist-init-addr HOST:PORT "
                "--node-rank K`"
            )
        store = host_store(config.dist_init_addr)
        addr = store_address(store)
        config = replace(config, dist_init_addr=addr)
        publish_config(store, config)
        launch = cls(config, store)
        atexit.register(launch.close)
        try:
            launch.procs = start_ranks(addr, range(1, config.ranks_per_node))
            wait_for_ranks(store, config.tp_size, launch.check_health)
            launch.control = init_groups(rank_config(config, 0), store, 0)
        except BaseException:
            launch.close()
            raise
        return launch

    def build_scheduler(self) -> Scheduler:
        """Rank 0's engine and scheduler, whose requests reach every rank."""
        sync = RequestSync(self.control, 0, self.check_health)
        try:
            scheduler = build_scheduler(rank_config(self.config, 0), 0, self.control, sync)
        except RuntimeError as e:  # a rank failed while loading: say which, and why
            self.check_health()
            raise RankFailedError(f"a tensor-parallel rank failed while loading: {e}") from e
        # Only now can `close` ask the ranks to stop: before, they may still be loading.
        self.sync = sync
        return scheduler

    def check_health(self) -> None:
        """Raise RankFailedError if a rank of this node has exited."""
        for rank, proc in self.procs.items():
            if proc.poll() is not None:
                why = failure_of(self.store, rank) or f"exit code {proc.returncode}"
                raise RankFailedError(
                    f"tensor-parallel rank {rank} (pid {proc.pid}) stopped ({why}); this engine "
                    "cannot continue: create a new one"
                )

    def watch(self, on_failure: Callable[[str], None], interval_s: float = 0.5) -> None:
        """Call `on_failure(reason)` from a background thread once a rank of this node exits
        (a server must go down even while it waits idle for requests)."""

        def loop() -> None:
            while not self._closed:
                try:
                    self.check_health()
                except RankFailedError as e:
                    if not self._closed:  # not one of the ranks `close` is stopping
                        on_failure(str(e))
                    return
                time.sleep(interval_s)

        threading.Thread(target=loop, name="minisgl-tp-watch", daemon=True).start()

    def close(self) -> None:
        """Tell the ranks to stop, wait for them (kill them if they hang), leave the groups."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self.sync is not None:
            with contextlib.suppress(RankFailedError):  # the ranks left are stopped below
                self.sync.stop()
        stop_processes(self.procs.values(), STOP_GRACE_S if self.sync else 0.0)
        destroy_groups()


# ---- nodes 1..nnodes-1 ---------------------------------------------------------------------


def run_node(
    dist_init_addr: str, node_rank: int, nnodes: int | None = None, tp_size: int | None = None
) -> int:
    """Run node `node_rank`'s ranks of the engine whose rank 0 listens at `dist_init_addr`;
    returns once they have stopped: 0, or the first failed rank's exit code. `nnodes` and
    `tp_size`, when given, must be rank 0's."""
    config = fetch_config(connect_store(dist_init_addr))
    if nnodes is not None and nnodes != config.nnodes:
        raise ValueError(f"nnodes: {nnodes} given here but rank 0 runs with {config.nnodes}")
    if tp_size is not None and tp_size != config.tp_size:
        raise ValueError(f"tp_size: {tp_size} given here but rank 0 runs with {config.tp_size}")
    if not 0 < node_rank < config.nnodes:
        raise ValueError(f"node_rank: must be in [1, {config.nnodes}), got {node_rank}")
    per = config.ranks_per_node
    procs = start_ranks(dist_init_addr, range(node_rank * per, (node_rank + 1) * per))
    try:
        codes = [proc.wait() for proc in procs.values()]
    finally:
        stop_processes(procs.values(), 0.0)
    return next((c for c in codes if c), 0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m minisgl.distributed.launch",
        description="Run tensor-parallel ranks of an engine whose rank 0 runs elsewhere.",
    )
    parser.add_argument("--dist-init-addr", required=True, help="rank 0's host:port")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--node-rank", type=int, help="run every rank of node K (1..nnodes-1)")
    which.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # one rank (internal)
    parser.add_argument("--nnodes", type=int, default=None, help="checked against rank 0's")
    args = parser.parse_args(argv)
    if args.rank is not None:
        run_worker(args.rank, args.dist_init_addr, os.getppid())
        # Stopped in order, groups left: skip the interpreter's second of tearing torch down,
        # which rank 0's `close` would otherwise wait for.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    logging.basicConfig(level=logging.INFO)
    try:
        code = run_node(args.dist_init_addr, args.node_rank, args.nnodes)
    except ValueError as e:  # a flag that does not fit rank 0's engine
        parser.error(str(e))
    raise SystemExit(code)


if __name__ == "__main__":
    main()
