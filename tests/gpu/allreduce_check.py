"""The symmetric-memory one-shot all-reduce against NCCL on 2+ GPUs of one host.

    python tests/gpu/allreduce_check.py [--nproc 2]        # spawns one process per GPU
    torchrun --nproc-per-node 2 tests/gpu/allreduce_check.py

(a) Through `minisgl.distributed.all_reduce` (the call the layers make), the result equals
NCCL's on random bf16 and fp32 tensors of several sizes, eagerly and replayed from a CUDA graph
(two chained all-reduces per graph, as in a decoder layer); (b) microseconds per all-reduce for
8 KB .. 1 MB, NCCL and one-shot, each replayed from a CUDA graph (what decode does) and eager.
Prints one PASS/FAIL line per check and the timing table last; exits 1 on any failure. Without
two GPUs it prints SKIP and exits 0. Never uses multicast (multimem) operations.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # minisgl without installing it

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from minisgl.distributed import TPInfo, all_reduce, reset_tp_info, set_tp_info  # noqa: E402
from minisgl.distributed.symm_all_reduce import (  # noqa: E402
    SymmAllReduce,
    init_symm_all_reduce,
)

HIDDEN = 4096  # Llama-3-8B: one decode row is 8 KB in bf16
TIMED_BYTES = [8 << 10, 64 << 10, 512 << 10, 1 << 20]
# (rows, cols): decode rows of the 8B model, sizes that are not multiples of a row, and (5, 7),
# whose 70 bytes are not 16-byte steps (NCCL takes it), as do fp32's 2 MB at 128 rows.
CHECK_SHAPES = [(1, HIDDEN), (8, HIDDEN), (64, HIDDEN), (128, HIDDEN), (1, 8), (3, 1368), (5, 7)]
GRAPH_ITERS = 50  # all-reduces captured in one timing graph
REPLAYS = 20
WATCHDOG_S = 300  # a rank stuck in a barrier fails the run instead of hanging it


def agree_all(ok: bool, group: dist.ProcessGroup) -> bool:
    t = torch.tensor([int(ok)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def close(got: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    """Equal up to the summation order (bitwise equal at 2 ranks in practice)."""
    diff = (got.float() - ref.float()).abs().max().item()
    tol = 2e-2 if got.dtype == torch.bfloat16 else 1e-5
    return diff <= tol * max(1.0, ref.float().abs().max().item()), diff


def check_eager(rank: int, ar: SymmAllReduce, report: Callable[[str, bool, str], None]) -> None:
    gen = torch.Generator(device="cuda").manual_seed(100 + rank)
    for dtype in (torch.bfloat16, torch.float32):
        for shape in CHECK_SHAPES:
            x = torch.randn(shape, generator=gen, device="cuda").to(dtype)
            ref = x.clone()
            dist.all_reduce(ref)
            got = all_reduce(x.clone())
            ok, diff = close(got, ref)
            path = "one-shot" if ar.accepts(x) else "NCCL"
            report(f"eager {str(dtype)[6:]:8} {tuple(shape)}", ok, f"{path}, max |diff| {diff:.2e}")


def check_graph(rank: int, report: Callable[[str, bool, str], None]) -> None:
    gen = torch.Generator(device="cuda").manual_seed(200 + rank)

    def layer(x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(x * 0.5)  # like o_proj's partial sums, then down_proj's
        return all_reduce(y + 1.0)

    for rows in (1, 16, 64):
        static = torch.zeros(rows, HIDDEN, dtype=torch.bfloat16, device="cuda")
        out: list[torch.Tensor] = []

        def step(out: list[torch.Tensor] = out, static: torch.Tensor = static) -> None:
            out.append(layer(static))

        graph = capture(step)
        worst, ok = 0.0, True
        for _ in range(3):  # new inputs each replay, as decode steps bring
            x = torch.randn(rows, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
            static.copy_(x)
            graph.replay()
            ref = x * 0.5
            dist.all_reduce(ref)
            ref = ref + 1.0
            dist.all_reduce(ref)
            good, diff = close(out[-1], ref)
            ok, worst = ok and good, max(worst, diff)
        report(f"graph bf16     ({rows}, {HIDDEN}) x2", ok, f"max |diff| {worst:.2e}")


def capture(fn: Callable[[], object], calls: int = 1) -> torch.cuda.CUDAGraph:
    """`calls` calls of `fn` as one CUDA graph, after a warm-up call on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(calls):
            fn()
    return graph


def time_graph(fn: Callable[[torch.Tensor], object], t: torch.Tensor) -> float:
    """Microseconds per call, GRAPH_ITERS calls captured in one graph and replayed (the same
    number on every rank: the calls meet in collectives)."""
    graph = capture(lambda: fn(t), GRAPH_ITERS)
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPLAYS * GRAPH_ITERS)


def time_eager(fn: Callable[[torch.Tensor], object], t: torch.Tensor) -> float:
    for _ in range(10):
        fn(t)
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(REPLAYS * GRAPH_ITERS):
        fn(t)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / (REPLAYS * GRAPH_ITERS)


def timings(ar: SymmAllReduce) -> list[tuple[int, float, float, float, float]]:
    rows = []
    for nbytes in TIMED_BYTES:
        # Zeros: summed over and over in place they stay finite, and cost the same.
        t = torch.zeros(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        assert ar.accepts(t), nbytes
        rows.append(
            (
                nbytes,
                time_graph(dist.all_reduce, t),
                time_graph(ar, t),
                time_eager(dist.all_reduce, t),
                time_eager(ar, t),
            )
        )
    return rows


def print_table(rows: list[tuple[int, float, float, float, float]]) -> None:
    print(f"\nus per all-reduce, bf16, {dist.get_world_size()} ranks ({GRAPH_ITERS}-call graphs)")
    print(f"{'size':>8} {'nccl graph':>11} {'1shot graph':>12} {'speedup':>8}", end="")
    print(f" {'nccl eager':>11} {'1shot eager':>12}")
    for nbytes, ng, cg, ne, ce in rows:
        size = f"{nbytes >> 10} KB" if nbytes < (1 << 20) else f"{nbytes >> 20} MB"
        print(f"{size:>8} {ng:11.1f} {cg:12.1f} {ng / cg:7.2f}x {ne:11.1f} {ce:12.1f}")


def run_rank(rank: int, world: int, init_method: str) -> bool:
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=init_method, rank=rank, world_size=world, device_id=device
    )
    control = dist.new_group(backend="gloo")
    try:
        ar = init_symm_all_reduce(
            dist.group.WORLD, device, 1, lambda ok: agree_all(ok, control), max(TIMED_BYTES)
        )
        if ar is None:
            if rank == 0:
                print("FAIL symm_mem all-reduce unavailable (see the log line above)")
            return False
        set_tp_info(TPInfo(rank, world, ar))
        failures = []

        def report(what: str, ok: bool, detail: str) -> None:
            if not ok:
                failures.append(what)
            if rank == 0:
                print(f"{'PASS' if ok else 'FAIL'} {what}: {detail}", flush=True)

        check_eager(rank, ar, report)
        check_graph(rank, report)
        ok = agree_all(not failures, control)
        rows = timings(ar)
        if rank == 0:
            print("PASS all checks" if ok else "FAIL some checks (on some rank)")
            print_table(rows)
        return ok
    finally:
        reset_tp_info()
        dist.barrier(group=control)
        dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()


def _spawned(rank: int, world: int, init_method: str) -> None:
    if not run_rank(rank, world, init_method):
        sys.exit(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks to spawn (not under torchrun)")
    args = ap.parse_args()
    if "LOCAL_RANK" in os.environ:  # torchrun started this rank
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return 0 if run_rank(rank, world, "env://") else 1
    if torch.cuda.device_count() < max(2, args.nproc):
        print(f"SKIP: needs {max(2, args.nproc)} CUDA GPUs, {torch.cuda.device_count()} visible")
        return 0
    import torch.multiprocessing as mp

    print(f"torch {torch.__version__}, {args.nproc}x {torch.cuda.get_device_name(0)}", flush=True)
    try:
        mp.spawn(_spawned, args=(args.nproc, f"tcp://127.0.0.1:{free_port()}"), nprocs=args.nproc)
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
        print(f"FAIL: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
