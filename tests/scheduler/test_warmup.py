"""The start-up warm-up (`minisgl.scheduler.warmup`): its steps reach every eager path, it leaves the
engine exactly as it found it, and greedy outputs after it are those of an engine without it.
With the Triton backend the kernels run in Triton's CPU interpreter, where the test records the
specialisation key of every launch (what a GPU would compile a variant for): after the warm-up,
serving launches no new one."""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import assert_kv_clean, force_fused_kernels, random_prompts, record_batches  # noqa: E402

from minisgl import LLM, SamplingParams  # noqa: E402
from minisgl.config import EngineConfig  # noqa: E402
from minisgl.core import BatchKind  # noqa: E402
from minisgl.engine import Engine  # noqa: E402
from minisgl.kvcache import PageAllocator  # noqa: E402
from minisgl.scheduler import Scheduler  # noqa: E402
from minisgl.scheduler.calibrate import REPEATS, calibration_plan  # noqa: E402
from minisgl.scheduler.warmup import (  # noqa: E402
    WarmupRun,
    moe_sweep,
    moe_token_counts,
    plan_sizes,
    run_warmup,
)


def _needs_interpreter() -> None:
    pytest.importorskip("triton", reason="Triton is not installed (optional dependency 'gpu')")
    from minisgl.kernels.attention.decode import _decode_split_kernel
    from minisgl.kernels.common import is_interpreted

    if not is_interpreted(_decode_split_kernel):
        pytest.skip("minisgl.kernels was imported before TRITON_INTERPRET=1 was set")


def make_engine(path: Any, **options: Any) -> Engine:
    return Engine(EngineConfig(model=str(path), dtype="float32", device="cpu", **options))


def with_graph_runner(engine: Engine, max_bs: int) -> None:
    """The padded decode step of CUDA graphs, run eagerly (`capture=False`) on the CPU."""
    from minisgl.engine.cuda_graph import CudaGraphRunner

    engine.graphs = CudaGraphRunner(engine, capture=False, max_bs=max_bs)


# ---- the plan ------------------------------------------------------------------------------------


def test_plan_sizes() -> None:
    s = plan_sizes(64, 8192, 4096)
    assert s is not None
    assert s.long == 65 and s.long - s.long_cached == 6  # past one decode split of 64 tokens
    assert all(n % 16 for n in (s.long, s.short, *s.chunks, s.filtered))
    # Small limits shrink every prefill row to half the budget; none at all leaves no plan.
    s = plan_sizes(64, 8, 4096)
    assert s is not None and max(s.long - s.long_cached, s.short, *s.chunks, s.filtered) <= 4
    s = plan_sizes(None, 8192, 12)
    assert s is not None and max(s.contexts) <= 12
    assert plan_sizes(64, 3, 4096) is None and plan_sizes(64, 8192, 6) is None


def test_moe_token_counts() -> None:
    assert moe_token_counts(8192) == [1 << k for k in range(14)]
    assert moe_token_counts(48) == [1, 2, 4, 8, 16, 32, 48]
    assert moe_token_counts(2) == [1, 2] and moe_token_counts(1) == [1]


# ---- state -------------------------------------------------------------------------------------


@contextmanager
def unchanged(allocator: PageAllocator) -> Iterator[None]:
    free, is_free = list(allocator._free), bytes(allocator._is_free)
    yield
    assert allocator._free == free and bytes(allocator._is_free) == is_free


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_steps_cover_every_eager_path_and_give_everything_back(tiny_model_dir, backend) -> None:
    if backend == "triton":
        _needs_interpreter()
    engine = make_engine(
        tiny_model_dir("llama3"),
        attention_backend=backend,
        page_size=4,
        max_running_requests=12,
        skip_warmup=True,
    )
    with_graph_runner(engine, max_bs=8)
    batches = record_batches(engine)
    allocator = PageAllocator(engine.num_pages)
    with unchanged(allocator):
        assert run_warmup(engine, allocator) == 6
    prefill, mixed, decode_graph, decode_eager = batches[0], batches[1], batches[3], batches[5]
    assert prefill.kind is BatchKind.MIXED and min(prefill.extend_lens) > 1
    assert prefill.prefix_lens[0] > 0  # from a (synthetic) prefix-cache hit
    assert mixed.extend_lens[:2] == [1, 1] and min(mixed.extend_lens[2:]) > 1
    assert not all(mixed.sample)  # a chunk that samples nothing
    assert batches[2].size == 1 and batches[2].prefix_lens[0] % engine.page_size
    assert decode_graph.kind is BatchKind.DECODE and engine.graphs is not None
    assert engine.graphs.can_run(decode_graph) and not engine.graphs.can_run(decode_eager)
    assert decode_eager.size == 9 and decode_eager.kind is BatchKind.DECODE
    assert batches[4].num_tokens == 1  # one row: the layers' batch-1 GEMV path
    # Batches of 1 and several requests, token counts odd and even.
    assert {b.size == 1 for b in batches} == {True, False}
    assert {b.num_tokens % 2 for b in batches} == {0, 1}
    # Every sampler path: greedy only, temperature only, filters with penalties and log-probs.
    params = [[s.params for s in b.seqs] for b in batches]
    assert any(all(p.greedy for p in ps) for ps in params)
    assert any(any(p.top_k > 1 and p.logprobs and p.has_penalties for p in ps) for ps in params)
    assert any(
        all(p.top_p == 1 and p.top_k < 1 and p.min_p == 0 for p in ps)
        and not all(p.greedy for p in ps)
        for ps in params
    )
    # A scheduler built on the engine afterwards finds every page and slot free.
    assert_kv_clean(SimpleNamespace(scheduler=Scheduler(engine), engine=engine))


def test_warmup_runs_with_the_first_scheduler_unless_skipped(tiny_model_dir) -> None:
    path = tiny_model_dir("llama3")
    engine = make_engine(path)
    Scheduler(engine)  # the latency target off (the default): the warm-up alone
    assert engine.num_steps == 5
    engine = make_engine(path, itl_target_ms="auto")
    assert engine.num_steps == 0  # an engine alone runs nothing
    sched = Scheduler(engine)
    # The warm-up's, then the step-time model's timed steps (each shape three times).
    timed = len(calibration_plan(False, 8192, 256, engine.max_context)) * REPEATS
    assert timed == 21 and engine.num_steps == 5 + timed
    assert sched.step_model.ready
    Scheduler(engine)  # once per engine: a second scheduler finds it warm
    assert engine.num_steps == 5 + timed
    llm = LLM(str(path), dtype="float32", device="cpu", skip_warmup=True)
    assert llm.engine.num_steps == 0


def test_small_limits_skip_or_shrink_the_steps(tiny_model_dir) -> None:
    path = tiny_model_dir("llama3")
    assert run_warmup(make_engine(path, max_running_requests=3, skip_warmup=True)) == 0
    assert run_warmup(make_engine(path, num_pages=8, page_size=4, skip_warmup=True)) == 0
    engine = make_engine(path, max_prefill_tokens=5, skip_warmup=True)
    batches = record_batches(engine)
    assert run_warmup(engine) == 5
    assert max(sum(e for e in b.extend_lens if e > 1) for b in batches) <= 5


def test_moe_sweep_gives_everything_back(tmp_path, monkeypatch) -> None:
    # Step 6 runs on CUDA only (the MoE kernels' tiles); here through the torch experts.
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "..", "models"))
    from test_qwen3_moe import save_tiny

    save_tiny(tmp_path, seed=0)
    engine = make_engine(tmp_path, max_prefill_tokens=40, max_context_len=64, skip_warmup=True)
    batches = record_batches(engine)
    allocator = PageAllocator(engine.num_pages)
    run = WarmupRun(engine, allocator)
    with unchanged(allocator):
        moe_sweep(run, 40)
    assert [b.num_tokens for b in batches] == [1, 2, 4, 8, 16, 32, 40]


# ---- outputs -----------------------------------------------------------------------------------


def test_greedy_outputs_equal_those_without_warmup(tiny_model_dir) -> None:
    path = str(tiny_model_dir("qwen3"))
    prompts = random_prompts(6, 384, seed=4, lo=2, hi=40)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outputs = []
    for skip in (True, False):
        llm = LLM(path, dtype="float32", device="cpu", page_size=4, max_prefill_tokens=24,
                  skip_warmup=skip)  # fmt: skip
        llm.scheduler = Scheduler(llm.engine, overlap=True)
        outputs.append([o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)])
        assert_kv_clean(llm)
    assert outputs[0] == outputs[1]


# ---- kernel variants -----------------------------------------------------------------------------


def specialisation_key(kernel: Any, args: tuple, kwargs: dict) -> tuple:
    """What a GPU compiles a variant of `kernel` for: constexprs, launch options, and per other
    argument its type, 16-byte alignment (pointers) and == 1 / % 16 (integers)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    dns = set(kernel.kwargs.get("do_not_specialize") or ())
    dns_align = set(kernel.kwargs.get("do_not_specialize_on_alignment") or ())
    params = inspect.signature(kernel.fn).parameters
    bound = dict(zip(params, args)) | {k: v for k, v in kwargs.items() if k in params}
    key: list[Any] = [kernel.fn.__name__]
    for name, p in params.items():
        value = bound.get(name, p.default)
        if "constexpr" in str(p.annotation):
            key.append((name, value))
        else:
            spec = native_specialize_impl(
                BaseBackend, value, False, name not in dns, name not in dns_align
            )
            key.append((name, *spec))
    key.append(tuple(sorted((k, v) for k, v in kwargs.items() if k not in params)))
    return tuple(key)


@contextmanager
def recorded_variants(monkeypatch) -> Iterator[set[tuple]]:
    """Every interpreted launch's specialisation key, with the CUDA-only kernels (fused layers,
    Gumbel sampling) switched on for CPU tensors."""
    from triton.runtime.interpreter import InterpretedFunction

    from minisgl.engine import sampler

    keys: set[tuple] = set()
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        keys.add(specialisation_key(self, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    force_fused_kernels(monkeypatch)
    monkeypatch.setattr(
        sampler, "use_fused", lambda logits, inp: not (inp.needs_sort or inp.needs_min_p)
    )
    yield keys


def test_serving_compiles_nothing_after_the_warmup(tiny_model_dir, monkeypatch) -> None:
    _needs_interpreter()
    pytest.importorskip("triton._C.libtriton", reason="needs Triton's specialisation function")
    path = str(tiny_model_dir("qwen3"))
    with recorded_variants(monkeypatch) as keys:
        llm = LLM(path, dtype="float32", device="cpu", attention_backend="triton", page_size=4,
                  max_running_requests=6, max_prefill_tokens=40, skip_warmup=True)  # fmt: skip
        llm.scheduler = Scheduler(llm.engine, overlap=True)
        run_warmup(llm.engine)  # eager decode steps only: each split count is the warm-up's
        warm = set(keys)
        prompts = random_prompts(4, 384, seed=9, lo=1, hi=60) + [[7] * 16, [9] * 70]
        kinds = [
            SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=3, temperature=0.7, seed=1, ignore_eos=True),
            SamplingParams(max_tokens=4, top_p=0.8, logprobs=True, seed=2, ignore_eos=True),
        ]
        params = [kinds[i % len(kinds)] for i in range(len(prompts))]
        llm.generate(prompts, params, use_tqdm=False)
    names = " ".join(k[0] for k in warm)
    assert all(part in names for part in ("decode", "extend", "norm", "gumbel")), names
    assert keys - warm == set(), [k[0] for k in keys - warm]


def test_calibration_times_a_step_past_the_largest_graph() -> None:
    """With prefilling graphs up to N tokens, start-up times an N + 1 token prefill: the step-time
    model's `eager` term (kernels launched one by one) needs a step of that kind."""
    from minisgl.scheduler.calibrate import CalibrationStep

    eager = CalibrationStep(0, 0, 2049)
    assert eager in calibration_plan(True, 8192, 256, 4096, graph_tokens=2048)
    assert eager not in calibration_plan(True, 8192, 256, 4096)  # no graphs: no such step
    assert eager not in calibration_plan(True, 2048, 256, 4096, graph_tokens=2048)  # over limit
