"""Start, run and stop tensor-parallel ranks.

Rank 0 lives in the process that takes requests (the offline `LLM`, or the server's scheduler
process) and holds a `TPLaunch`: it hosts the rendezvous, starts the other ranks of its node and
stops them on `close`. Every other rank runs `run_worker` in a process of its own: it builds the
same engine as rank 0 (from rank 0's config, read from the rendezvous store) and steps its own
scheduler in lockstep with rank 0's, fed by the `RequestSync`. On nodes 1..nnodes-1,
`python -m minisgl.runtime.ranks --dist-init-addr HOST:PORT --node-rank K` starts the node's
ranks and waits for them.

Each node sizes its ranks' KV pools from its own memory (`NodeMemory`: a node may give its
ranks less than node 0 does); before any rank allocates its pool, the ranks agree on the
smallest page count, so that every scheduler counts the same pages and every engine runs the
same warm-up.

Ranks start as fresh interpreters (`python -m minisgl.runtime.ranks --rank R`) rather than
through multiprocessing's spawn, which re-imports the caller's main module: a script that
creates `LLM(tp_size=2)` without an `if __name__ == "__main__"` guard would start itself again.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from minisgl.config import EngineConfig
from minisgl.distributed import RankFailedError
from minisgl.distributed.group import (
    STORE_TIMEOUT_S,
    agree_on_min,
    connect_store,
    destroy_groups,
    host_store,
    init_groups,
    store_address,
)
from minisgl.engine import Engine
from minisgl.runtime.child import (
    ChildProcess,
    first_exited,
    freeze_gc,
    ignore_sigint,
    stop_processes,
    watch_parent,
)
from minisgl.scheduler import EngineStopped, RequestSync, Scheduler

logger = logging.getLogger(__name__)

MODULE = "minisgl.runtime.ranks"  # `python -m MODULE` runs ranks
STOP_GRACE_S = 10.0  # how long `close` waits for the ranks to leave before it terminates them


@dataclass(frozen=True)
class NodeMemory:
    """What this node gives its ranks' KV pools, where it differs from rank 0's config (None:
    rank 0's value). The ranks agree on the smallest pool, so a node only ever lowers it."""

    mem_fraction: float | None = None  # share of each GPU's memory (CUDA)
    cpu_kv_gib: float | None = None  # KV budget of each rank (CPU)

    def apply(self, config: EngineConfig) -> EngineConfig:
        return replace(config, **{k: v for k, v in asdict(self).items() if v is not None})

    def argv(self) -> list[str]:
        """The flags of `main` that pass this on to a rank process."""
        return [
            arg
            for k, v in asdict(self).items()
            if v is not None
            for arg in (f"--{k.replace('_', '-')}", str(v))
        ]


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


def build_scheduler(config: EngineConfig, control: Any, sync: RequestSync) -> Scheduler:
    """This rank's engine and scheduler. Every rank's engine builds its pool and CUDA graphs
    for the same page count, the smallest that any rank's memory holds, so the schedulers' warm-up
    steps and admissions are the same on every rank (schedulers that counted different pages
    would admit different requests and fall out of step)."""
    engine = Engine(config, agree_num_pages=lambda pages: agree_on_min(pages, control))
    return Scheduler(engine, sync=sync)


def start_scheduler(config: EngineConfig) -> tuple[Scheduler, TPLaunch | None]:
    """This process's scheduler over its engine; at tp > 1 it is rank 0's, and the returned
    `TPLaunch` runs this node's other ranks until its `close`."""
    if config.tp_size == 1:
        return Scheduler(Engine(config)), None
    tp = TPLaunch.start(config)
    try:
        return tp.build_scheduler(), tp
    except BaseException:
        tp.close()
        raise


def run_steps(scheduler: Scheduler) -> None:
    """A worker rank's loop: each step waits for rank 0's news, then runs the same batch."""
    freeze_gc()
    try:
        while True:
            scheduler.step()
    except EngineStopped:
        logger.info("rank 0 stopped the engine")


# ---- what the ranks tell each other through rank 0's store ---------------------------------------
# What the tensor-parallel ranks tell each other outside the model, through rank 0's store
# (`minisgl.distributed.group`): rank 0's config, who has joined, why a rank failed.


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


# ---- ranks 1..N-1 --------------------------------------------------------------------------------


def run_worker(rank: int, dist_init_addr: str, parent_pid: int, memory: NodeMemory) -> None:
    """Entry point of tensor-parallel rank `rank` >= 1, in a process of its own."""
    store = connect_store(dist_init_addr)
    try:
        # Rank 0's config: every rank must build the same engine.
        cfg = memory.apply(rank_config(fetch_config(store), rank))
        _setup_worker(rank, cfg, parent_pid)
        mark_joined(store, rank)
        control = init_groups(cfg, store, rank)
        run_steps(build_scheduler(cfg, control, RequestSync(control, rank)))
    except BaseException as e:
        report_failure(store, rank, e)
        raise
    finally:
        destroy_groups()


def _setup_worker(rank: int, config: EngineConfig, parent_pid: int) -> None:
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s tp{rank} %(levelname)s %(name)s: %(message)s"
    )
    # Rank 0 alone decides when to stop. SIGTERM keeps its default: a rank waiting inside a
    # collective would not run a Python handler until the collective returns.
    ignore_sigint()
    if not config.device.startswith("cuda") and not os.environ.get("OMP_NUM_THREADS"):
        # The node's cores are shared by its ranks; more threads than that only thrash. (An
        # OMP_NUM_THREADS set by the user, e.g. for processes run side by side, wins.)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.ranks_per_node))
    watch_parent(parent_pid)


def start_ranks(
    dist_init_addr: str, ranks: Iterable[int], memory: NodeMemory
) -> dict[int, ChildProcess]:
    """Start `run_worker` for each rank, each in a fresh interpreter."""
    env = dict(os.environ)
    # The ranks import this very minisgl, wherever the caller found it.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", MODULE, "--dist-init-addr", dist_init_addr]
    cmd += memory.argv()
    return {
        r: ChildProcess(
            f"tensor-parallel rank {r}", subprocess.Popen([*cmd, "--rank", str(r)], env=env)
        )
        for r in ranks
    }


# ---- rank 0 --------------------------------------------------------------------------------------


class TPLaunch:
    """Rank 0's handle on the tensor-parallel group: `start`, `build_scheduler`, `close`."""

    def __init__(self, config: EngineConfig, store: dist.Store) -> None:
        self.config = config
        self.store = store
        self.procs: dict[int, ChildProcess] = {}
        self.control: Any = None
        self.sync: RequestSync | None = None
        self._closed = False

    @classmethod
    def start(cls, config: EngineConfig) -> TPLaunch:
        """Host the rendezvous, start this node's other ranks and join the process groups."""
        if config.node_rank != 0:
            raise ValueError(
                f"node_rank: rank 0 runs on node 0, not {config.node_rank}; start the ranks of "
                f"node K with `{NODE_COMMAND}`"
            )
        store = host_store(config.dist_init_addr)
        addr = store_address(store)
        config = replace(config, dist_init_addr=addr)
        publish_config(store, config)
        launch = cls(config, store)
        atexit.register(launch.close)
        try:
            launch.procs = start_ranks(addr, range(1, config.ranks_per_node), NodeMemory())
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
            scheduler = build_scheduler(rank_config(self.config, 0), self.control, sync)
        except RuntimeError as e:  # a rank failed while loading: say which, and why
            self.check_health()
            raise RankFailedError(f"a tensor-parallel rank failed while loading: {e}") from e
        # Only now can `close` ask the ranks to stop: before, they may still be loading.
        self.sync = sync
        return scheduler

    def check_health(self) -> None:
        """Raise RankFailedError if a rank of this node has exited."""
        gone = first_exited(self.procs.values())
        if gone is None:
            return
        rank = next(r for r, c in self.procs.items() if c is gone)
        why = failure_of(self.store, rank) or f"exit code {gone.exit_code}"
        raise RankFailedError(
            f"tensor-parallel rank {rank} (pid {gone.pid}) stopped ({why}); this engine cannot "
            "continue: create a new one"
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


# ---- nodes 1..nnodes-1 ---------------------------------------------------------------------------


def run_node(
    dist_init_addr: str,
    node_rank: int,
    nnodes: int | None = None,
    tp_size: int | None = None,
    memory: NodeMemory = NodeMemory(),
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
    memory.apply(config)  # a bad value fails here, by name, rather than in every rank
    per = config.ranks_per_node
    procs = start_ranks(dist_init_addr, range(node_rank * per, (node_rank + 1) * per), memory)
    try:
        codes = [proc.wait() for proc in procs.values()]
    finally:
        stop_processes(procs.values(), 0.0)
    return next((c for c in codes if c), 0)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m {MODULE}",
        description="Run tensor-parallel ranks of an engine whose rank 0 runs elsewhere.",
    )
    parser.add_argument("--dist-init-addr", required=True, help="rank 0's host:port")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--node-rank", type=int, help="run every rank of node K (1..nnodes-1)")
    which.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # one rank (internal)
    parser.add_argument("--nnodes", type=int, default=None, help="checked against rank 0's")
    mem = parser.add_argument_group(
        "this node's memory", "default: rank 0's; the ranks use the smallest KV pool of any rank"
    )
    mem.add_argument("--mem-fraction", type=float, default=None, help="share of each GPU")
    mem.add_argument("--cpu-kv-gib", type=float, default=None, help="KV pool of each CPU rank")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    memory = NodeMemory(args.mem_fraction, args.cpu_kv_gib)
    if args.rank is not None:
        run_worker(args.rank, args.dist_init_addr, os.getppid(), memory)
        # Stopped in order, groups left: skip the interpreter's second of tearing torch down,
        # which rank 0's `close` would otherwise wait for.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    logging.basicConfig(level=logging.INFO)
    try:
        code = run_node(args.dist_init_addr, args.node_rank, args.nnodes, memory=memory)
    except ValueError as e:  # a flag that does not fit rank 0's engine
        parser.error(str(e))
    raise SystemExit(code)


if __name__ == "__main__":
    main()
