"""CPU use of a process tree while it works: which process is the bottleneck of a run?

    python3 scripts/proc_cpu.py --pid SERVER_PID --pid CLIENT_PID --seconds 60

Every `--interval` seconds it reads /proc (Linux) for the given processes and all their
descendants; it stops after `--seconds` or on SIGTERM / SIGINT and prints, per process (its OS
name, e.g. minisgl:sched, and pid), the CPU it used over the whole window and its busiest
interval, as % of one core, then one JSON object. A process at ~100% is single-thread bound.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def tree(roots: list[int]) -> list[int]:
    seen, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.append(pid)
            todo += children(pid)
    return seen


def cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def name(pid: int) -> str:
    """The OS name, or for a plain python the module it runs (`-m NAME`)."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "?"
    if comm.startswith("python") and "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1].rsplit(".", 1)[-1]
    return comm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pid", type=int, action="append", required=True)
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--interval", type=float, default=0.5)
    args = p.parse_args()
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    peak: dict[int, float] = {}
    names: dict[int, str] = {}
    start = prev_t = time.monotonic()
    while not stop and time.monotonic() - start < args.seconds:
        time.sleep(args.interval)
        now = time.monotonic()
        for pid in tree(args.pid):
            used = cpu_seconds(pid)
            if used is None:
                continue
            names.setdefault(pid, name(pid))
            if pid in last:
                peak[pid] = max(peak.get(pid, 0.0), (used - last[pid]) / (now - prev_t))
            first.setdefault(pid, used)
            last[pid] = used
        prev_t = now
    wall = prev_t - start
    spent = {pid: last[pid] - first[pid] for pid in last}
    print(f"{'process':<18} {'pid':>7} {'cpu s':>7} {'mean %':>7} {'peak %':>7}  ({wall:.1f} s)")
    rows = []
    for pid in sorted(spent, key=lambda q: -spent[q]):
        mean, top = 100 * spent[pid] / wall, 100 * peak.get(pid, 0.0)
        rows.append({"pid": pid, "name": names[pid], "cpu_s": spent[pid], "mean_pct": mean,
                     "peak_pct": top})  # fmt: skip
        if spent[pid] > 0.05:
            print(f"{names[pid]:<18} {pid:>7} {spent[pid]:>7.1f} {mean:>7.0f} {top:>7.0f}")
    print(json.dumps({"wall_s": wall, "processes": rows}))


if __name__ == "__main__":
    main()
