"""The prefill budget (`minisgl.scheduler.budget`) against a fixed step-time model: a step that
prefills beside decodes stays within the latency target, chunks end on page boundaries, a
prompt alone prefills at full size, and a target no prefill can meet plans as without one."""

from __future__ import annotations

from helpers import FixedStepModel
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.scheduler.budget import AUTO_MULTIPLE, PrefillBudget, min_chunk, token_budget
from minisgl.scheduler.step_time import StepShape

MODEL = FixedStepModel()
MAX_TOKENS, PAGE = 8192, 16

rows = st.lists(
    st.tuples(st.integers(0, 4000), st.integers(1, 6000)), min_size=1, max_size=6
)  # (prefix, tokens left) of the prefill rows in the order they ask


@settings(max_examples=300, deadline=None)
@given(
    decodes=st.integers(1, 256),
    context=st.integers(1, 4096),
    target_ms=st.one_of(st.none(), st.floats(1.0, 20.0)),
    asks=rows,
)
def test_a_step_with_decodes_stays_within_the_target(
    decodes: int, context: int, target_ms: float | None, asks: list[tuple[int, int]]
) -> None:
    shape = StepShape(decodes, 0, decodes * context, False)
    target = None if target_ms is None else target_ms / 1e3
    budget = PrefillBudget.plan(MAX_TOKENS, PAGE, shape, MODEL, target)
    goal = AUTO_MULTIPLE * MODEL.predict(shape) if target is None else target
    smallest = shape.with_chunk(
        0, min(min_chunk(MAX_TOKENS, PAGE), token_budget(MAX_TOKENS, decodes))
    )
    # The target applies exactly when a step with a minimal chunk can meet it.
    assert (budget.limit is not None) == (MODEL.predict(smallest) <= goal)
    granted = 0
    for prefix, left in asks:
        n = budget.size(prefix, left)
        assert 0 <= n <= left
        if n == 0:
            continue
        if budget.limit is not None and n < left:
            assert (prefix + n) % PAGE == 0  # a chunk that leaves more ends on a page boundary
        budget.take(prefix, n)
        granted += n
    assert granted <= token_budget(MAX_TOKENS, decodes)
    if budget.limit is not None:
        assert MODEL.predict(budget.shape) <= goal
        assert budget.predicted() == MODEL.predict(budget.shape)


def test_a_prompt_alone_prefills_at_full_size() -> None:
    # Nothing decodes: nobody waits on the step, whatever the target.
    for target in (None, 1e-4, 5e-3):
        budget = PrefillBudget.plan(MAX_TOKENS, PAGE, StepShape(0, 0, 0, False), MODEL, target)
        assert budget.limit is None
        assert budget.size(0, 100_000) == MAX_TOKENS


def test_the_budget_shrinks_with_the_decodes_and_takes_the_rest_of_the_target() -> None:
    target = 10e-3
    sizes = []
    for decodes in (1, 64, 256):
        shape = StepShape(decodes, 0, decodes * 1000, False)
        n = PrefillBudget.plan(MAX_TOKENS, PAGE, shape, MODEL, target).size(0, 100_000)
        # The largest page multiple whose step fits: one more page would not.
        assert MODEL.predict(shape.with_chunk(0, n)) <= target
        assert MODEL.predict(shape.with_chunk(0, n + PAGE)) > target
        sizes.append(n)
    assert sizes[0] > sizes[1] > sizes[2] > 0


def test_a_step_stays_within_the_largest_graph_when_going_eager_would_miss_the_target() -> None:
    # Prefilling steps up to GRAPH tokens replay a graph; one more token costs 12 ms of eager
    # launches (the model's `eager` term). A 15 ms target fits 1,500 more prompt tokens by the
    # per-token cost, but not the jump: the chunk stops where the step still fits the graphs.
    graph, model = 512, FixedStepModel(eager=12e-3)
    shape = StepShape(64, 0, 64 * 1000, False, graph)
    budget = PrefillBudget.plan(MAX_TOKENS, PAGE, shape, model, 15e-3)
    n = budget.size(0, 100_000)
    assert n == (graph - 64) // PAGE * PAGE and not shape.with_chunk(0, n).eager
    budget.take(0, n)
    assert budget.size(0, 100_000) == 0  # a second prompt would tip it over too
    # Without graphs every prefilling step pays the same fixed price: the per-token cost rules.
    plain = StepShape(64, 0, 64 * 1000, False)
    m = PrefillBudget.plan(MAX_TOKENS, PAGE, plain, model, 15e-3).size(0, 100_000)
    assert m > graph and model.predict(plain.with_chunk(0, m)) <= 15e-3


def test_the_last_chunk_of_a_prompt_need_not_end_on_a_page() -> None:
    shape = StepShape(4, 0, 400, False)
    budget = PrefillBudget.plan(MAX_TOKENS, PAGE, shape, MODEL, 10e-3)
    assert budget.size(32, 37) == 37  # fits whole: the prompt's end
    assert budget.size(5, 100_000) % PAGE == 11  # ends at a page boundary: 5 + n


def test_an_unattainable_target_plans_as_without_one() -> None:
    # 256 decodes alone take ~5 ms: a 3 ms target cannot be met, so the step is planned by the
    # token limit (as with the target off), not starved of prefill.
    shape = StepShape(256, 0, 256 * 1000, False)
    for target in (3e-3, 0.0):
        budget = PrefillBudget.plan(MAX_TOKENS, PAGE, shape, MODEL, target)
        assert budget.limit is None
        assert budget.size(0, 100_000) == token_budget(MAX_TOKENS, 256) == MAX_TOKENS - 256


def test_a_model_not_ready_yet_applies_no_target() -> None:
    shape = StepShape(8, 0, 800, False)
    budget = PrefillBudget.plan(MAX_TOKENS, PAGE, shape, FixedStepModel(ready=False), 1e-3)
    assert budget.limit is None and budget.size(0, 100_000) == MAX_TOKENS - 8


def test_the_token_limit_keeps_a_quarter_for_prefill() -> None:
    assert token_budget(8, 7) == 2 and token_budget(8, 3) == 5 and token_budget(8192, 0) == 8192
