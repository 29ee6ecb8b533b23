"""The step-time model (`minisgl.scheduler.step_time`): its features match the plans the
scheduler builds, and the online fit finds a machine's coefficients, shrugs off outliers,
follows a machine that changes, and keeps what start-up measured for what recent steps do not
exercise."""

from __future__ import annotations

import random

import pytest

from minisgl.core import Batch, SamplingParams, SeqInfo
from minisgl.scheduler.step_time import LinearStepTime, StepShape

# A machine: 1 ms a step, 3 ms more for a step that prefills, 8 ms more again for one over its
# largest prefilling graph (GRAPH tokens), 20 us a decode row, 1 us a prompt token, 5 ns a KV
# token read.
TRUE = {"base": 1e-3, "mixed": 3e-3, "eager": 8e-3, "decode_row": 20e-6, "prefill_token": 1e-6}
TRUE["kv_token"] = 5e-9
GRAPH = 2048


def machine(shape: StepShape, scale: float = 1.0) -> float:
    t = TRUE["base"] + TRUE["mixed"] * shape.mixed + TRUE["eager"] * shape.eager
    t += TRUE["decode_row"] * shape.decode_rows
    t += TRUE["prefill_token"] * shape.prefill_tokens + TRUE["kv_token"] * shape.kv_tokens
    return t * scale


def per_unit(coef: dict[str, float]) -> dict[str, float]:
    """Coefficients per row / token (the model's are per scaled unit)."""
    from minisgl.scheduler import step_time as st

    scales = {"decode_row": st.DECODE_SCALE, "prefill_token": st.PREFILL_SCALE}
    scales["kv_token"] = st.KV_SCALE
    return {k: v / scales.get(k, 1.0) for k, v in coef.items()}


def random_shape(rng: random.Random, prefill: bool | None = None) -> StepShape:
    decodes = rng.randint(0, 256)
    kv = sum(rng.randint(16, 4096) for _ in range(decodes))
    tokens = 0
    if prefill if prefill is not None else rng.random() < 0.3:
        tokens = rng.randint(2, 4096)
        kv += tokens + rng.randint(0, 2048)
    if decodes == 0 and tokens == 0:
        decodes, kv = 1, 100
    return StepShape(
        decodes, tokens, kv, tokens > 0, GRAPH, tokens > 0 and decodes + tokens > GRAPH
    )


def test_shape_of_a_plan_counts_what_the_step_computes() -> None:
    seq = SeqInfo(0, SamplingParams(), 0, 10)
    batch = Batch([seq] * 4, [9, 30, 0, 40], [1, 1, 12, 1], [True] * 4, [0] * 4)
    assert StepShape.of(batch) == StepShape(3, 12, 10 + 31 + 12 + 41, True)
    assert not StepShape.of(Batch([seq], [5], [1], [True], [0])).mixed
    # The budget builds a step row by row; the result is the plan's shape.
    built = StepShape(2, 0, 10 + 31, False).with_chunk(0, 12).with_chunk(40, 1)
    assert built == StepShape.of(batch)


def test_a_step_past_the_largest_graph_is_eager() -> None:
    """`graph_tokens`: the engine's largest prefilling graph. A prefilling step of more tokens
    (decode rows count: one each) is eager, whether seen as a plan or built chunk by chunk."""
    seq = SeqInfo(0, SamplingParams(), 0, 10)
    batch = Batch([seq] * 3, [9, 30, 0], [1, 1, 15], [True] * 3, [0] * 3)  # 17 tokens
    assert not StepShape.of(batch, 17).eager and StepShape.of(batch, 16).eager
    assert not StepShape.of(batch).eager  # no graphs: the mixed term prices every such step
    decode = Batch([seq] * 3, [9, 30, 5], [1, 1, 1], [True] * 3, [0] * 3)
    assert not StepShape.of(decode, 2).eager  # decode steps have graphs of their own
    start = StepShape(2, 0, 10 + 31, False, 16)
    assert not start.with_chunk(0, 14).eager
    assert start.with_chunk(0, 15).eager and start.with_chunk(0, 15) == StepShape.of(batch, 16)
    assert start.with_chunk(0, 14).with_chunk(3, 1).eager  # a decode row tips it over
    assert not start.with_chunk(5, 1).with_chunk(6, 1).eager  # decodes only: not prefilling


def test_the_fit_finds_the_machine() -> None:
    rng = random.Random(0)
    model = LinearStepTime()
    for _ in range(400):
        shape = random_shape(rng)
        model.observe(shape, machine(shape) * rng.uniform(0.97, 1.03))
    model.refit()
    got = per_unit(model.coefficients())
    # Decode rows and their KV reads go together in this workload (as in serving), so the fit
    # may trade one for the other; the eager term and the prompt tokens somewhat too (eager
    # steps are the large ones). The fixed costs are pinned down.
    for term in ("base", "mixed", "eager"):
        assert got[term] == pytest.approx(TRUE[term], rel=0.15), term
    assert got["prefill_token"] == pytest.approx(TRUE["prefill_token"], rel=0.25)
    for _ in range(100):
        shape = random_shape(rng)
        assert model.predict(shape) == pytest.approx(machine(shape), rel=0.05)


def test_outliers_barely_move_the_fit() -> None:
    rng = random.Random(1)
    model = LinearStepTime()
    for i in range(400):
        shape = random_shape(rng)
        stall = 100.0 if i % 50 == 49 else 1.0  # a GC pause every 50 steps
        model.observe(shape, machine(shape) * stall)
    model.refit()
    shape = StepShape(32, 0, 32 * 500, False)
    assert model.predict(shape) == pytest.approx(machine(shape), rel=0.1)


def test_the_fit_follows_a_machine_that_slows_down() -> None:
    rng = random.Random(2)
    model = LinearStepTime()
    for _ in range(300):
        shape = random_shape(rng)
        model.observe(shape, machine(shape))
    shape = StepShape(16, 512, 16 * 300 + 600, True)
    assert model.predict(shape) == pytest.approx(machine(shape), rel=0.05)
    for _ in range(3000):  # twice as slow from now on
        s = random_shape(rng)
        model.observe(s, machine(s, scale=2.0))
    assert model.predict(shape) == pytest.approx(machine(shape, scale=2.0), rel=0.05)


def test_start_up_values_stay_for_what_serving_does_not_exercise() -> None:
    rng = random.Random(3)
    model = LinearStepTime()
    for _ in range(40):  # start-up: every kind of step
        s = random_shape(rng)
        model.observe(s, machine(s))
    model.refit()
    model.anchor()
    prefill_cost = model.coefficients()["prefill_token"]
    for _ in range(5000):  # then only decodes, on a machine whose decodes got slower
        s = random_shape(rng, prefill=False)
        model.observe(s, machine(s) + 1e-3)
    assert model.coefficients()["prefill_token"] == pytest.approx(prefill_cost, rel=0.2)
    assert model.predict(StepShape(8, 0, 800, False)) == pytest.approx(
        machine(StepShape(8, 0, 800, False)) + 1e-3, rel=0.05
    )


def test_predictions_never_fall_as_a_step_grows() -> None:
    rng = random.Random(4)
    model = LinearStepTime()
    for _ in range(64):  # noisy data from a machine whose prompt tokens cost nothing
        s = random_shape(rng)
        model.observe(s, rng.uniform(1e-3, 2e-3))
    assert all(c >= 0 for c in model.coefficients().values())
    base = StepShape(4, 10, 500, True)
    assert model.predict(base.with_chunk(100, 500)) >= model.predict(base) >= 0


def test_it_is_ready_after_a_few_steps() -> None:
    model = LinearStepTime(min_samples=4)
    for i in range(4):
        assert not model.ready
        model.observe(StepShape(i + 1, 0, 10 * (i + 1), False), 1e-3)
    assert model.ready


def test_rank0_samples_replayed_elsewhere_give_the_same_model() -> None:
    # Tensor parallelism: rank 0 measures and sends its samples with the next step's requests
    # (the same packing as `RequestSync` broadcasts); another rank's model, fed those bytes,
    # must plan the same budgets: equal bit for bit.
    import msgpack

    from minisgl.scheduler.sync import RequestSync
    from minisgl.scheduler.timing import StepTimer

    sync = RequestSync(group=None, rank=0)
    rank0 = StepTimer(LinearStepTime(), True, sync.publish_step_times)
    other = StepTimer(LinearStepTime(), True, measures=False)

    class Sink:
        def apply_step_times(self, samples: list, anchor: bool) -> None:
            other.apply(samples, anchor)

    rng = random.Random(5)
    rank0.record([(s, machine(s)) for s in (random_shape(rng) for _ in range(20))], anchor=True)
    for _ in range(100):
        s = random_shape(rng)
        rank0.completed(s)  # a real (tiny) measured period
        rank0.record([(s, machine(s) * rng.uniform(0.9, 1.5))])
    data, sync._ops = msgpack.packb(sync._ops), []
    for op in msgpack.unpackb(data):
        RequestSync._apply(op, Sink())  # type: ignore[arg-type]
    assert other.model.samples == rank0.model.samples == 220  # type: ignore[attr-defined]
    assert other.model.coefficients() == rank0.model.coefficients()
    assert other.model.prior == rank0.model.prior  # type: ignore[attr-defined]
