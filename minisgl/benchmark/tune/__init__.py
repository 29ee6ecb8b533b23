"""The kernels' tuners, one entry: `python -m minisgl.benchmark.tune KERNEL [options]`.

Each sweeps a kernel's tiles (or a switch) on the CUDA GPU at hand through one search loop
(`search`) and prints the table to paste beside the kernel: `gemv` (`--fp8`), `skinny`,
`fp8-gemm` (`linear.py`); `decode`, `extend`, `mixed` (`attention.py`); `moe`, `moe-fp8`, `w8a8`
(`moe.py`). The last line is one JSON object.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from minisgl.benchmark.common import Row, attempt


def search(
    configs: Iterable[Any],
    run: Callable[[Any], Row],
    key: str,
    label: Callable[[Any], Row] = lambda c: {"config": c},
) -> list[Row]:
    """Every tuner's loop: `run(config)` for each config gives its row, with its time under
    `key`; a config that does not compile, fit, run or pass its check becomes an error row
    (`label(config)` and the error). Rows fastest first, error rows last."""
    rows = [attempt(label(c), run, c) for c in configs]
    return sorted(rows, key=lambda r: r.get(key, math.inf))


def fastest(rows: Sequence[Row], key: str, group: Sequence[str]) -> list[Row]:
    """The fastest row of each `group` value, error rows left out."""
    best: dict[tuple[object, ...], Row] = {}
    for r in rows:
        g = tuple(r.get(k) for k in group)
        if key in r and (g not in best or r[key] < best[g][key]):
            best[g] = r
    return list(best.values())


def checked(error: float, tolerance: float = 2e-2) -> float:
    """`error` when within `tolerance`; a wrong variant raises (its row becomes an error row)."""
    if not error <= tolerance:  # NaN too: the variant failed to run
        raise ValueError(f"relative error {error:.3g} over {tolerance:g}")
    return error
