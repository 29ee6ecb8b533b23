"""Start-up timing of a few synthetic steps: the step-time model's first data
(`minisgl.scheduler.step_time`).

Runs after the warm-up (whose own steps are no use for timing: they are where kernels compile,
and tiny). Each step shape below runs `REPEATS` times through `Engine.forward_batch` on the
warm-up's synthetic requests (`WarmupRun`), waiting for each to complete; the first run of a
shape is not timed (a new GEMM shape costs a cuBLAS heuristic lookup once). A timed step is
host plus device time with nothing overlapped, an upper bound of what the same step costs in
the overlapped loop; the online refinement takes it from there.

The shapes vary each feature of the model on its own: decode batch size, decode context, prefill
tokens, a prefill's cached prefix, decodes and a prefill together, and a prefill one token larger
than the engine's largest prefilling graph (when it has them). Sizes are odd (no new Triton
integer specialisation) and smaller on a CPU, where the test suite starts many engines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from minisgl.core import pages_for
from minisgl.engine import Engine
from minisgl.kvcache import PageAllocator
from minisgl.scheduler.step_time import StepShape
from minisgl.scheduler.warmup import GREEDY, WarmupRun

REPEATS = 3


@dataclass(frozen=True)
class CalibrationStep:
    decodes: int  # decode rows
    context: int  # tokens each decode row reads
    prefill: int  # tokens of one prefill row (0: none)
    prefix: int = 0  # that row's cached prefix

    @property
    def valid(self) -> bool:
        """Limits too small for the shape shrink it to nothing."""
        return (
            (self.decodes == 0 or self.context >= 1)
            and self.prefill >= 0
            and (self.prefill >= 2 if self.decodes == 0 else self.prefill != 1)
        )

    def slots(self) -> int:
        return self.decodes + (REPEATS if self.prefill else 0)

    def pages(self, page_size: int) -> int:
        decode = self.decodes * pages_for(self.context + REPEATS, page_size)
        prefill = REPEATS * pages_for(self.prefix + self.prefill, page_size) if self.prefill else 0
        return decode + prefill


def calibration_plan(
    on_cuda: bool,
    max_prefill_tokens: int,
    max_running: int,
    max_context: int,
    graph_tokens: int = 0,
) -> list[CalibrationStep]:
    """The shapes to time, within the engine's limits (pages are checked when run)."""
    batch, short, long, small, large = (
        (63, 255, 4095, 255, 2047) if on_cuda else (7, 15, 127, 15, 63)
    )
    batch = max(1, min(batch, max_running - REPEATS - 1))
    cap_context = max_context - REPEATS - 1
    short, long = min(short, cap_context), min(long, cap_context)
    small = min(small, max_prefill_tokens - batch, max_context - 1)
    large = min(large, max_prefill_tokens, max_context - 1)
    prefix = max(0, min(long, max_context - small - 1))
    plan = [
        CalibrationStep(1, short, 0),
        CalibrationStep(batch, short, 0),
        CalibrationStep(batch, long, 0),
        CalibrationStep(0, 0, small),
        CalibrationStep(0, 0, large),
        CalibrationStep(0, 0, small, prefix),
        CalibrationStep(batch, short, small),
    ]
    eager = graph_tokens + 1  # the smallest prefilling step past the graphs
    if graph_tokens > 0 and eager <= min(max_prefill_tokens, max_context - 1):
        plan.append(CalibrationStep(0, 0, eager))
    return [s for s in plan if s.valid]


def calibrate(
    engine: Engine, allocator: PageAllocator | None = None
) -> list[tuple[StepShape, float]]:
    """Time the plan's steps on an engine without requests: (shape, seconds) of each timed
    step. Shapes that do not fit the pool or the request slots are left out."""
    graph_tokens = engine.graph_tokens
    run = WarmupRun(engine, allocator or PageAllocator(engine.num_pages))
    cfg = engine.config
    plan = calibration_plan(
        engine.device.type == "cuda",
        cfg.max_prefill_tokens,
        cfg.max_running_requests,
        engine.max_context,
        graph_tokens,
    )
    samples: list[tuple[StepShape, float]] = []
    for spec in plan:
        fits = spec.pages(engine.page_size) <= run.allocator.num_free
        if fits and spec.slots() <= cfg.max_running_requests:
            with run.released():
                samples += _time_steps(run, spec, graph_tokens)
    return samples


def _time_steps(
    run: WarmupRun, spec: CalibrationStep, graph_tokens: int
) -> list[tuple[StepShape, float]]:
    decodes = [run.add(spec.context, GREEDY, cached=spec.context - 1) for _ in range(spec.decodes)]
    samples = []
    for i in range(REPEATS):
        rows = [(r, 1) for r in decodes]
        if spec.prefill:
            req = run.add(spec.prefix + spec.prefill, GREEDY, cached=spec.prefix)
            rows.append((req, spec.prefill))
        start = time.perf_counter()
        batch = run.step(rows)
        assert run.last is not None
        run.last.wait()
        if i > 0:
            samples.append((StepShape.of(batch, graph_tokens), time.perf_counter() - start))
    return samples
