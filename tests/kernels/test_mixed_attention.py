"""The mixed-step attention kernel (`minisgl.kernels.attention.mixed`) against the torch reference.

Every case pads the step to a capacity (Tp rows, Bmax requests) as a CUDA graph's bucket
would, and one test reuses the same buffers for several compositions (what a replay does).
Without CUDA the kernel runs in Triton's CPU interpreter, so sizes stay small.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed (optional dependency 'gpu')")

from minisgl.kernels.attention import reference as ref  # noqa: E402
from minisgl.kernels.attention.mixed import (
    MixedConfig,
    _mixed_kernel,
    max_work_items,
    mixed_attention,
)
from minisgl.kernels.attention.testing import PagedKV, cu_seqlens, random_paged_kv  # noqa: E402
from minisgl.kernels.common import is_interpreted, split_counters  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not is_interpreted(_mixed_kernel):
    pytest.skip(
        "minisgl.kernels was imported before TRITON_INTERPRET=1 was set; "
        "run with TRITON_INTERPRET=1 in the environment",
        allow_module_level=True,
    )

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
# Small tiles so that short test prompts span several q-blocks and key blocks.
SMALL = MixedConfig(rows_wide=16, block_n=16, block_n_narrow=16)


@dataclass
class Step:
    """One step padded to a capacity: the kernel's inputs and the reference's."""

    kv: PagedKV  # Bmax rows of block table / seq_lens; rows past the step are spare requests
    cu_extend: torch.Tensor  # [Bmax+1] int32, constant past the step's requests
    ext: list[int]  # new tokens of the step's requests


def padded_step(
    prefix: list[int], ext: list[int], max_requests: int, page_size: int, hkv: int, d: int,
    kv_dtype: torch.dtype,
) -> Step:  # fmt: skip
    """Requests past the step hold real contexts (a previous step's, say) but no rows."""
    spare = max_requests - len(ext)
    seq = [p + e for p, e in zip(prefix, ext, strict=True)] + [7] * spare
    kv = random_paged_kv(seq, page_size, hkv, d, kv_dtype, DEVICE)
    return Step(kv, cu_seqlens(ext + [0] * spare, DEVICE), ext)


def expected_of(step: Step, q: torch.Tensor, scale: float) -> torch.Tensor:
    b, t = len(step.ext), sum(step.ext)
    kv = step.kv
    ext = torch.tensor(step.ext, dtype=torch.int32, device=DEVICE)
    return ref.extend_attention_ref(
        q[:t], kv.k_cache, kv.v_cache, kv.block_table[:b], kv.seq_lens[:b], ext,
        step.cu_extend[: b + 1], kv.page_size, scale, kv.kv_scales,
    )  # fmt: skip


def check(step: Step, q: torch.Tensor, out: torch.Tensor, scale: float, tol: float) -> None:
    t = sum(step.ext)
    assert torch.isfinite(out).all(), "NaN/Inf: a row unwritten or read outside a context"
    expected = expected_of(step, q, scale)
    err = (out[:t].float() - expected).abs().max() / expected.abs().max().clamp_min(1e-6)
    assert err.item() <= tol
    assert (out[t:] == 0).all(), "padding rows are zeros"


def run(
    step: Step, q: torch.Tensor, num_splits: int, config: MixedConfig | None = SMALL
) -> torch.Tensor:
    kv = step.kv
    out = torch.full_like(q, float("nan"))
    return mixed_attention(
        q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, step.cu_extend, kv.page_size,
        q.shape[-1] ** -0.5, num_splits=num_splits, config=config, out=out,
        kv_scales=kv.kv_scales,
    )  # fmt: skip


# (dtype, page_size, head_dim, q heads, kv heads, num_splits, prefix_lens, extend_lens, Tp, Bmax)
CASES = [
    # decodes at several contexts beside one prompt with a cached prefix
    (torch.float32, 16, 64, 4, 2, 1, [40, 3, 70, 21], [1, 1, 1, 37], 48, 6),
    (torch.float32, 1, 64, 8, 2, 3, [55, 0, 17, 90], [1, 30, 1, 5], 48, 5),
    # split decodes, a 2-token row, a prompt; 14 padding rows over many idle programs
    (torch.float32, 16, 64, 4, 2, 2, [40, 3, 0, 21], [1, 1, 30, 2], 48, 6),
    (torch.bfloat16, 16, 64, 4, 2, 2, [33, 120, 0], [1, 1, 26], 40, 4),
    (torch.bfloat16, 1, 128, 6, 2, 1, [12, 0, 8], [9, 20, 1], 32, 3),  # GQA 3, padded to 4
    (torch.float16, 16, 64, 4, 4, 4, [64, 80, 15], [1, 2, 18], 24, 4),  # no GQA, a 2-token row
    (torch.float32, 16, 32, 16, 1, 2, [5, 31], [1, 17], 20, 2),  # GQA 16: one token per tile
    # only decodes; only one prompt
    (torch.float32, 16, 64, 4, 2, 3, [100, 7, 50], [1, 1, 1], 8, 4),
    # a 2-token row at 31, 32 whose second split (key 32) the first token must not see
    (torch.float32, 16, 64, 4, 2, 2, [31, 50], [2, 1], 8, 3),
    (torch.bfloat16, 16, 64, 4, 2, 1, [0], [33], 40, 2),
]


@pytest.mark.parametrize("dtype,ps,d,hq,hkv,splits,prefix,ext,tp,bmax", CASES)
def test_mixed_matches_reference(
    dtype: torch.dtype, ps: int, d: int, hq: int, hkv: int, splits: int, prefix: list[int],
    ext: list[int], tp: int, bmax: int,
) -> None:  # fmt: skip
    torch.manual_seed(hash((ps, d, hq, tuple(ext))) % 2**31)
    step = padded_step(prefix, ext, bmax, ps, hkv, d, dtype)
    q = torch.randn(tp, hq, d, dtype=dtype, device=DEVICE)
    out = run(step, q, splits)
    check(step, q, out, d**-0.5, TOL[dtype])
    assert not split_counters(q.device, bmax * hkv).any(), "split counters back at zero"


@pytest.mark.parametrize("dtype,splits", [(torch.float32, 2), (torch.bfloat16, 1)])
def test_mixed_fp8_kv_matches_reference(dtype: torch.dtype, splits: int) -> None:
    torch.manual_seed(11)
    step = padded_step([50, 9, 0], [1, 1, 21], 4, 16, 2, 64, torch.float8_e4m3fn)
    q = torch.randn(32, 4, 64, dtype=dtype, device=DEVICE)
    check(step, q, run(step, q, splits), 64**-0.5, TOL[torch.bfloat16])


GPU_ONLY = pytest.mark.skipif(DEVICE != "cuda", reason="a CUDA graph needs a GPU")


@pytest.mark.parametrize("graph", [False, pytest.param(True, marks=GPU_ONLY)])
def test_one_launch_serves_every_composition(graph: bool) -> None:
    """One launch, captured in a CUDA graph on a GPU (else the same call again, which is what
    a replay does): the same buffers and launch parameters, new contents. The pool is
    rewritten in place, the block table, lengths and rows too."""
    torch.manual_seed(5)
    tp, bmax, ps, hq, hkv, d = 40, 5, 16, 4, 2, 64
    compositions = [
        ([40, 3, 70, 21, 9], [1, 1, 1, 1, 30]),  # four decodes and a prompt
        ([0, 5], [24, 16]),  # two prompts, three spare requests
        ([90, 15, 60], [1, 1, 1]),  # decodes only, most rows padding
        ([0], [40]),  # one prompt fills the bucket
    ]
    steps = [padded_step(*c, bmax, ps, hkv, d, torch.float32) for c in compositions]
    # Fixed buffers, sized for the largest: each step's pool and table are copied into them.
    slots = max(s.kv.k_cache.shape[0] for s in steps)
    width = max(s.kv.block_table.shape[1] for s in steps)
    k_cache = torch.empty(slots, hkv, d, device=DEVICE)
    v_cache = torch.empty_like(k_cache)
    table = torch.empty(bmax, width, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.empty(bmax, dtype=torch.int32, device=DEVICE)
    cu = torch.empty(bmax + 1, dtype=torch.int32, device=DEVICE)
    q = torch.empty(tp, hq, d, device=DEVICE)
    out = torch.empty_like(q)

    def launch() -> None:
        mixed_attention(
            q, k_cache, v_cache, table, seq_lens, cu, ps, d**-0.5, num_splits=2, config=SMALL,
            out=out,
        )  # fmt: skip

    if graph:  # compiled and the split counters allocated first: a capture cannot do either
        cu.zero_()
        launch()
        torch.cuda.synchronize()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            launch()
    for step in steps:
        n = step.kv.k_cache.shape[0]
        for dst, src in ((k_cache, step.kv.k_cache), (v_cache, step.kv.v_cache)):
            dst.fill_(float("nan"))
            dst[:n].copy_(src)
        table.zero_()  # entries past a request's pages point at another request's page
        table[:, : step.kv.block_table.shape[1]].copy_(step.kv.block_table)
        seq_lens.copy_(step.kv.seq_lens)
        cu.copy_(step.cu_extend)
        q.normal_()
        out.fill_(float("nan"))
        captured.replay() if graph else launch()
        kv = PagedKV(k_cache, v_cache, table, seq_lens, step.kv.seq_lens_host, ps)
        check(Step(kv, cu, step.ext), q, out, d**-0.5, TOL[torch.float32])


def test_work_items_cover_any_step() -> None:
    """The bound holds for the step that needs the most attention items (every request wide
    with one token more than a block, or every request narrow)."""
    gpad, rows_w, splits = 2, 16, 3  # 8 tokens per block, 8 per narrow tile
    for tp, bmax in ((48, 6), (2048, 256), (32, 64), (100, 3)):
        bound = max_work_items(tp, bmax, gpad, rows_w, splits)
        worst_wide = 0
        for n in range(1, bmax + 1):  # n wide requests sharing tp tokens as evenly as can be
            lens = [tp // n + (i < tp % n) for i in range(n)]
            if min(lens) > 8:
                worst_wide = max(worst_wide, sum(-(-e // 8) for e in lens))
        narrow = min(bmax, tp) * splits
        assert max(worst_wide, narrow) < bound


def test_rejects_bad_splits() -> None:
    step = padded_step([3], [1], 1, 16, 1, 32, torch.float32)
    q = torch.randn(4, 1, 32, device=DEVICE)
    with pytest.raises(ValueError, match="num_splits"):
        run(step, q, 0)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_default_config(dtype: torch.dtype) -> None:
    """The production tiles at Qwen3-0.6B's head layout on a W4-like mix, scaled down."""
    torch.manual_seed(6)
    prefix, ext = [300, 41, 150, 0, 260], [1, 1, 1, 90, 1]
    step = padded_step(prefix, ext, 8, 16, 8, 128, dtype)
    q = torch.randn(128, 16, 128, dtype=dtype, device=DEVICE)
    check(step, q, run(step, q, 2, None), 128**-0.5, TOL[dtype])
