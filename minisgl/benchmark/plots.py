"""The serving benchmark's latency plots (`--plot OUT.png`): inter-token gaps on the server
(the fraction of gaps above each latency, on log axes, so that the tail shows) and the time to
first token at the client, one curve per request rate. Needs matplotlib (the `plot` extra:
`pip install 'minisgl[plot]'`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def gaps_ms(requests: list[list[float]]) -> list[float]:
    """Sorted gaps between consecutive server token times; `requests`: [priority, t0, t1, ...]
    each."""
    out = []
    for r in requests:
        times = r[1:]
        out += [(b - a) * 1e3 for a, b in zip(times, times[1:])]
    return sorted(out)


def plot_latencies(runs: dict[str, dict[str, Any]], out: str | Path) -> None:
    """`runs`: {label: {"token_times": [[priority, t0, ...], ...], "ttft_each_ms": [...]}}."""
    try:
        import matplotlib
    except ImportError:  # the measurements still count: say so and carry on
        print(f"no plot {out}: it needs matplotlib (pip install 'minisgl[plot]')", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (itl, ttft) = plt.subplots(1, 2, figsize=(12, 5))
    for label, run in runs.items():
        g = gaps_ms(run["token_times"])
        if g:
            n = len(g)
            p99 = g[min(n - 1, int(n * 0.99))]
            itl.plot(g, [1 - i / n for i in range(n)], label=f"{label} (p99 {p99:.1f} ms)")
        t = sorted(run["ttft_each_ms"])
        if t:
            ttft.plot(t, [(i + 1) / len(t) for i in range(len(t))], label=label)
    itl.set(xscale="log", yscale="log", ylim=(1e-4, 1), xlabel="inter-token gap on the server (ms)",
            ylabel="fraction of gaps above")  # fmt: skip
    itl.axhline(0.01, color="grey", lw=0.5, ls="--")
    ttft.set(xlabel="time to first token at the client (ms)", ylabel="fraction of requests")
    for ax in (itl, ttft):
        ax.grid(True, which="both", lw=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
