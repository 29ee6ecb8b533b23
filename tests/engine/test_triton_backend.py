"""The Triton attention backend and the padded decode step of the CUDA-graph runner, run
through the whole engine on the CPU (Triton's interpreter), against the torch backend.

On the CPU the runner executes its padded step eagerly (`capture=False`): the same inputs,
padding rows and spare KV page as a replayed graph, minus the capture.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed (optional dependency 'gpu')")

from helpers import assert_kv_clean, random_prompts  # noqa: E402

from minisgl import LLM, SamplingParams  # noqa: E402
from minisgl.engine.cuda_graph import CudaGraphRunner, graph_batch_sizes  # noqa: E402
from minisgl.kernels.common import split_counters  # noqa: E402
from minisgl.scheduler import Scheduler  # noqa: E402

NUM_TOKENS = 12


@pytest.fixture(scope="module", autouse=True)
def _interpreted():
    if torch.cuda.is_available():
        pytest.skip("the GPU suite (tests/gpu) covers this natively")
    from minisgl.kernels.attention.decode import _decode_split_kernel
    from minisgl.kernels.common import is_interpreted

    if not is_interpreted(_decode_split_kernel):
        pytest.skip("minisgl.kernels was imported before TRITON_INTERPRET=1 was set")


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    path = tiny_model_dir("llama3")
    prompts = random_prompts(5, 384, seed=21, lo=3, hi=30)
    prompts.append(prompts[0][:17] + [5, 6, 7])  # shares a prefix that ends mid-page
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    ref = LLM(str(path), dtype="float32", device="cpu", attention_backend="torch")
    want = [o["token_ids"] for o in ref.generate(prompts, params, use_tqdm=False)]
    return path, prompts, params, want


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_batch_sizes(100)[-3:] == [88, 96, 100]
    assert graph_batch_sizes(256)[-1] == 256 and len(graph_batch_sizes(256)) == 35


@pytest.mark.parametrize(
    "options",
    [{"page_size": 4, "max_prefill_tokens": 9, "cache": "radix"}, {"page_size": 1}],
    ids=["page4-chunked-radix", "page1"],
)
def test_triton_backend_matches_torch(setup, options):
    path, prompts, params, want = setup
    llm = LLM(str(path), dtype="float32", device="cpu", attention_backend="triton", **options)
    got = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert_kv_clean(llm)


def test_triton_backend_fp8_kv_reuses_poisoned_pages(setup):
    """An FP8 pool (V pages transposed, read whole: `KVPool`) through the Triton kernels, two
    rounds over one small pool, so the second round's requests get pages the first gave back
    and the KV debug mode (on in the tests) poisoned: the same tokens as the torch backend's FP8
    path (the same stored bytes), and no NaN byte in any V page (the kernels weigh a page's
    slots past the context 0, which NaN would survive; the interpreter's e4m3 has no NaN, so
    only the bytes show it here)."""
    path, prompts, params, _ = setup
    assert os.environ.get("MINISGL_DEBUG_KV") == "1"
    options = dict(page_size=4, cache="naive", kv_cache_dtype="fp8_e4m3", dtype="float32")
    ref = LLM(str(path), device="cpu", attention_backend="torch", **options)
    want = [o["token_ids"] for o in ref.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(path), device="cpu", attention_backend="triton", num_pages=40, **options)
    for _ in range(2):
        got = [o["token_ids"] for o in llm.generate(prompts[::-1], params, use_tqdm=False)]
        assert got[::-1] == want
    assert_kv_clean(llm)
    pool = llm.engine.pool
    for layer in range(pool.num_layers):
        assert not ((pool.v(layer).view(torch.uint8) & 0x7F) == 0x7F).any()


def test_padded_decode_steps_with_overlap(setup):
    path, prompts, params, want = setup
    llm = LLM(
        str(path),
        dtype="float32",
        device="cpu",
        attention_backend="triton",
        page_size=4,
        max_running_requests=12,
    )
    runner = CudaGraphRunner(llm.engine, capture=False, max_bs=64)
    assert runner.sizes == [1, 2, 4, 8, 12]
    llm.engine.graphs = runner
    llm.scheduler = Scheduler(llm.engine, overlap=True)
    padded = []
    original = runner.run

    def spy(batch):
        padded.append(runner.padded_size(batch.size) - batch.size)
        return original(batch)

    runner.run = spy  # type: ignore[method-assign]
    got = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert any(padded), "some decode step should have had padding rows"
    # The decode kernel's split counters are back at zero after every step.
    assert not split_counters(torch.device("cpu"), 64 * llm.engine.pool.num_kv_heads).any()
    # Padding rows wrote only the spare page, which no request owns.
    assert llm.engine.dummy_loc == llm.engine.num_pages * llm.engine.page_size
    assert llm.engine.pool.num_pages == llm.engine.num_pages + 1
    assert_kv_clean(llm)


@pytest.mark.slow
@pytest.mark.parametrize("num_splits", [1, 2])
def test_whole_step_mixed_graphs(setup, num_splits):
    """Prefilling steps as one padded forward per token bucket (`whole_step`), every layer's
    attention one `mixed_attention` over static buffers: chunked prompts beside decodes, a
    cached prefix, padding rows at the spare slot. The torch backend's tokens."""
    from minisgl.engine.piecewise import PiecewiseGraphRunner

    path, prompts, params, want = setup
    llm = LLM(
        str(path), dtype="float32", device="cpu", attention_backend="triton", page_size=4,
        max_prefill_tokens=9, max_running_requests=8, cache="radix",
    )  # fmt: skip
    runner = PiecewiseGraphRunner(llm.engine, 16, capture=False, whole_step=True)
    assert runner.mixed is not None
    runner.mixed.num_splits = num_splits
    steps: list[tuple[int, int]] = []
    original = runner.run

    def spy(batch):
        steps.append((batch.size, batch.num_tokens))
        return original(batch)

    runner.run = spy  # type: ignore[method-assign]
    llm.engine.pieces = runner
    got = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    # Steps that mixed decodes with a prompt chunk went through it, padded to the bucket.
    assert any(1 < b < t < 16 for b, t in steps), steps
    assert not split_counters(torch.device("cpu"), 8 * llm.engine.pool.num_kv_heads).any()
    assert_kv_clean(llm)
