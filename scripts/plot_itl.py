"""Plot inter-token latency distributions from the serving benchmark's `--token-times-out` files.

python scripts/plot_itl.py OUT.png policies.times.json[:label] [more.json[:label] ...]

Each file holds {target: {rate: [[priority, t0, t1, ...], ...]}} (the server's own time of each
output token). One curve per (file, target, rate): the fraction of gaps above a latency, on log
axes, so that the tail is visible. Needs matplotlib (not a dependency of minisgl).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def gaps_ms(requests: list[list[float]]) -> list[float]:
    out = []
    for r in requests:
        times = r[1:]
        out += [(b - a) * 1e3 for a, b in zip(times, times[1:])]
    return sorted(out)


def main(argv: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    png, files = argv[0], argv[1:]
    fig, ax = plt.subplots(figsize=(8, 5))
    for spec in files:
        path, _, label = spec.partition(":")
        data = json.loads(Path(path).read_text())
        for target, by_rate in data.items():
            for rate, requests in by_rate.items():
                g = gaps_ms(requests)
                n = len(g)
                above = [1 - i / n for i in range(n)]
                p99 = g[int(n * 0.99)]
                name = f"{label or Path(path).stem} target={target} rate={rate} (p99 {p99:.1f} ms)"
                ax.plot(g, above, label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(1e-4, 1)
    ax.axhline(0.01, color="grey", lw=0.5, ls="--")
    ax.set_xlabel("inter-token gap on the server (ms)")
    ax.set_ylabel("fraction of gaps above")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", lw=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1:])
