"""The step-time model: how long a step of a given shape keeps its requests waiting.

A step's time is modelled as linear in five features of its shape,

    t = base + mixed * [the step prefills] + eager * [too large for the graphs]
          + decode * rows + prefill * tokens + kv * kv_tokens

(`mixed` is the fixed price of a step that is not a plain decode: a graph of its token bucket,
or no graph at all; `eager` the further price of a prefilling step with more tokens than the
engine's largest graph (`graph_tokens`): kernels launched one by one, new GEMM shapes; `kv` the
price of a context token read by attention). The coefficients start from a
few timed steps at start-up (`minisgl.scheduler.warmup.calibrate`) and follow the measured
step periods online, by exponentially weighted least squares: a forgetting factor lets the
model follow the machine, a ridge pull towards the start-up fit keeps the directions that
recent steps do not exercise (no prefill for a while) where start-up put them, and a Huber
weight keeps a rare outlier (a GC pause, a page fault) from dragging the fit.

The arithmetic is plain Python floats on purpose: every tensor-parallel rank replays rank 0's
observations (`minisgl.scheduler.sync`) and must reach the same coefficients bit for bit, on
any CPU, since the prefill budget, and so the batch, depends on them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from minisgl.core import Batch

# Feature scales: each feature is O(1) at typical sizes, so one ridge strength fits all.
DECODE_SCALE = 64.0
PREFILL_SCALE = 1024.0
KV_SCALE = 65536.0
TERMS = ("base", "mixed", "eager", "decode_row", "prefill_token", "kv_token")


@dataclass(frozen=True)
class StepShape:
    """What a step's time depends on."""

    decode_rows: int  # rows that add one token
    prefill_tokens: int  # tokens of the rows that add more than one
    kv_tokens: int  # context tokens the step's attention reads (its rows' sequence lengths)
    mixed: bool  # not a plain decode step (a token bucket's graph, or none; GEMM shapes vary)
    # The most tokens a prefilling step may have and still replay a graph (0: none does).
    graph_tokens: int = 0
    eager: bool = False  # a prefilling step over `graph_tokens` (> 0): no graph

    @staticmethod
    def of(batch: Batch, graph_tokens: int = 0) -> StepShape:
        decode = sum(1 for e in batch.extend_lens if e == 1)
        prefill = batch.num_tokens - decode
        eager = prefill > 0 and 0 < graph_tokens < batch.num_tokens
        return StepShape(decode, prefill, sum(batch.seq_lens), prefill > 0, graph_tokens, eager)

    def with_chunk(self, prefix: int, tokens: int) -> StepShape:
        """This step plus a prefill row computing `tokens` tokens after `prefix` cached ones."""
        if tokens <= 0:
            return self
        if tokens == 1:
            eager = self.eager or (self.mixed and 0 < self.graph_tokens < self.num_tokens + 1)
            kv = self.kv_tokens + prefix + 1
            return replace(self, decode_rows=self.decode_rows + 1, kv_tokens=kv, eager=eager)
        kv = self.kv_tokens + prefix + tokens
        eager = 0 < self.graph_tokens < self.num_tokens + tokens
        prefill = self.prefill_tokens + tokens
        return replace(self, prefill_tokens=prefill, kv_tokens=kv, mixed=True, eager=eager)

    @property
    def num_tokens(self) -> int:
        return self.decode_rows + self.prefill_tokens

    def features(self) -> list[float]:
        return [
            1.0,
            1.0 if self.mixed else 0.0,
            1.0 if self.eager else 0.0,
            self.decode_rows / DECODE_SCALE,
            self.prefill_tokens / PREFILL_SCALE,
            self.kv_tokens / KV_SCALE,
        ]


class StepTimeModel(Protocol):
    """What the scheduler asks of a step-time model (tests substitute a fixed one)."""

    @property
    def ready(self) -> bool:
        """Whether predictions are worth acting on (enough steps seen)."""
        ...

    def predict(self, shape: StepShape) -> float:
        """Seconds a step of `shape` takes; >= 0 and non-decreasing in every feature."""
        ...

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A step of `shape` took `seconds`."""
        ...

    def anchor(self) -> None:
        """The start-up measurements are in: what they say is the default from now on."""
        ...

    def coefficients(self) -> dict[str, float]:
        """The model's parameters by name (for logs and /metrics; may be empty)."""
        ...


class LinearStepTime:
    """The linear model of the module docstring, fitted by exponentially weighted, ridge-
    regularised, Huber-weighted least squares (refitted every `refit_every` observations)."""

    def __init__(
        self,
        forget: float = 0.998,  # weight of the past per observation: a memory of ~500 steps
        ridge: float = 0.1,  # pull towards `prior`, in observations' worth
        refit_every: int = 8,
        min_samples: int = 8,
        huber: float = 4.0,  # residuals beyond this many mean absolute residuals weigh less
    ) -> None:
        n = len(TERMS)
        self.forget, self.ridge, self.refit_every = forget, ridge, refit_every
        self.min_samples, self.huber = min_samples, huber
        self.coef = [0.0] * n  # seconds per unit of each feature
        self.prior = [0.0] * n
        self._a = [[0.0] * n for _ in range(n)]  # weighted sum of x x^T
        self._b = [0.0] * n  # weighted sum of x y
        self._mean_abs_residual = 0.0
        self.samples = 0

    @property
    def ready(self) -> bool:
        return self.samples >= self.min_samples

    def predict(self, shape: StepShape) -> float:
        return max(0.0, _dot(self.coef, shape.features()))

    def observe(self, shape: StepShape, seconds: float) -> None:
        x = shape.features()
        residual = abs(seconds - _dot(self.coef, x))
        weight = 1.0
        if self.samples >= self.min_samples:
            limit = self.huber * max(self._mean_abs_residual, 1e-5)
            weight = min(1.0, limit / residual) if residual > 0 else 1.0
            self._mean_abs_residual += 0.05 * (min(residual, limit) - self._mean_abs_residual)
        else:
            self._mean_abs_residual += (residual - self._mean_abs_residual) / (self.samples + 1)
        self._accumulate(x, seconds, weight)
        self.samples += 1
        if self.samples <= self.min_samples or self.samples % self.refit_every == 0:
            self.refit()

    def _accumulate(self, x: list[float], y: float, w: float) -> None:
        f = self.forget
        for i, xi in enumerate(x):
            row = self._a[i]
            for j, xj in enumerate(x):
                row[j] = f * row[j] + w * xi * xj
            self._b[i] = f * self._b[i] + w * xi * y

    def refit(self) -> None:
        """Solve the regularised normal equations; every coefficient is kept >= 0 (a step
        never gets cheaper by being larger), which keeps predictions monotone."""
        n = len(TERMS)
        a = [[self._a[i][j] + (self.ridge if i == j else 0.0) for j in range(n)] for i in range(n)]
        b = [self._b[i] + self.ridge * self.prior[i] for i in range(n)]
        self.coef = [max(0.0, c) for c in _solve(a, b)]

    def anchor(self) -> None:
        """Make the current fit the prior that the ridge pulls towards (after start-up)."""
        self.prior = list(self.coef)

    def coefficients(self) -> dict[str, float]:
        return dict(zip(TERMS, self.coef))


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b (Gaussian elimination with partial pivoting; `a` is symmetric positive
    definite here thanks to the ridge, so no pivot is zero)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= factor * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
