"""Measuring step periods in the scheduler's loop, for the step-time model and /metrics.

A step's period is what its requests feel: the time from the previous step's tokens reaching
the host to this step's (its `ForwardOutput` waited for: the wait the loop does anyway, so no
extra device sync), or from the start of the loop iteration that launched it when the loop was
idle before. With overlap scheduling the gap that ends with step N's tokens holds the host's
work of launching step N+1 beside the device's work on step N, so its sample takes the step
kind (mixed or decode, in a graph or eager: the host's big cost) of the step launched in that iteration and the
rest of its shape from step N.

Samples go to the model in batches of `SAMPLE_BATCH`. With tensor parallelism only rank 0
measures; each batch travels to the other ranks with the next step's requests (`publish`), and
every rank applies it at the same point of the schedule, so all models stay equal.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from minisgl.scheduler.step_time import StepShape, StepTimeModel

SAMPLE_BATCH = 8

Sample = tuple[StepShape, float]


@dataclass
class StepTimes:
    """Predicted and measured periods of the steps measured since start (the model's
    prediction just before it saw each one)."""

    steps: int = 0
    predicted_s: float = 0.0
    measured_s: float = 0.0
    abs_error_s: float = 0.0

    def add(self, predicted: float, measured: float) -> None:
        self.steps += 1
        self.predicted_s += predicted
        self.measured_s += measured
        self.abs_error_s += abs(predicted - measured)


class StepTimer:
    """`publish`: hands a batch of samples to the other ranks (None: a single rank).
    `measures`: False on ranks other than 0, which take rank 0's samples (`apply`)."""

    def __init__(
        self,
        model: StepTimeModel,
        overlap: bool,
        publish: Callable[[list[Sample], bool], None] | None = None,
        measures: bool = True,
    ) -> None:
        self.model = model
        self.overlap = overlap
        self.publish = publish
        self.measures = measures
        self.totals = StepTimes()
        self._pending: list[Sample] = []
        self._gap_start = time.perf_counter()
        self._launched_now: StepShape | None = None  # launched in the current iteration

    def iteration(self, busy: bool) -> None:
        """A loop iteration starts; `busy`: the previous one left work in flight (so this one
        followed it at once)."""
        self._launched_now = None
        if not busy:
            self._gap_start = time.perf_counter()

    def launched(self, shape: StepShape) -> None:
        self._launched_now = shape

    def completed(self, shape: StepShape) -> None:
        """The tokens of a step of `shape` are on the host now."""
        now = time.perf_counter()
        seconds, self._gap_start = now - self._gap_start, now
        if not self.measures:
            return
        if self.overlap:
            launched = self._launched_now
            # The host's cost is the launched step's: its kind (graph of a bucket, or eager).
            mixed = launched is not None and launched.mixed
            eager = launched is not None and launched.eager
            shape = replace(shape, mixed=mixed, eager=eager)
        self.record([(shape, seconds)])

    def record(self, samples: list[Sample], anchor: bool = False) -> None:
        """Queue measured samples (rank 0). `anchor` (the start-up calibration): hand them
        over now and make the fit they give the model's prior."""
        self._pending += samples
        if anchor or len(self._pending) >= SAMPLE_BATCH:
            batch, self._pending = self._pending, []
            if self.publish is not None:
                self.publish(batch, anchor)
            self.apply(batch, anchor)

    def apply(self, samples: list[Sample], anchor: bool = False) -> None:
        """Feed samples to the model (every rank, in the same order)."""
        for shape, seconds in samples:
            if self.model.ready:
                self.totals.add(self.model.predict(shape), seconds)
            self.model.observe(shape, seconds)
        if anchor:
            self.model.anchor()
