"""The one-row GEMV with its fused prologue / epilogue (`minisgl.kernels.gemv`) and its batch
version (`minisgl.kernels.rows_gemm`) against the same math in fp64 torch. Without CUDA it runs in Triton's CPU interpreter (small shapes); the sm_90
compile check runs the real compiler without a GPU."""

from __future__ import annotations

import functools
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available() and __name__ != "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed (optional dependency 'gpu')")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _kernels():
    """(minisgl.kernels.gemv, minisgl.kernels.rows_gemm), runnable here: on the CPU only when
    Triton's interpreter was on before minisgl.kernels was first imported (skip otherwise)."""
    from minisgl.kernels import gemv, rows_gemm
    from minisgl.kernels.common import is_interpreted

    if DEVICE == "cpu" and not is_interpreted(gemv._gemv_kernel):
        pytest.skip("minisgl.kernels was imported before TRITON_INTERPRET=1 was set")
    return gemv, rows_gemm


def _reference(x, w, bias, residual, norm_weight, eps, act=False):
    xf = x.double()
    if act:
        gate, up = xf.chunk(2, dim=-1)
        xf = F.silu(gate) * up
    if norm_weight is not None:
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    y = xf @ w.double().t()
    if bias is not None:
        y = y + bias.double()
    if residual is not None:
        y = y + residual.double()
    return y


def check_fused(fused, gen, m, n, k, dtype, norm, extras, bf16_tol=2e-2):
    """`fused(x, w, ...)` on random [m, k] rows (with the prologue `norm`: True, False or
    "act", and the epilogue `extras`) against `_reference`."""
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    act = norm == "act"
    x = (torch.randn(m, 2 * k if act else k, generator=gen) * 2).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if extras in ("bias", "both") else None
    res = torch.randn(m, n, generator=gen).to(dtype) if extras in ("residual", "both") else None
    g = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype) if norm is True else None
    want = _reference(x, w, bias, res, g, 1e-5, act)
    dev = [None if t is None else t.to(DEVICE) for t in (x, w, bias, res, g)]
    got = fused(dev[0], dev[1], bias=dev[2], residual=dev[3], norm_weight=dev[4], eps=1e-5, act=act)
    assert got.shape == (m, n) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else bf16_tol
    torch.testing.assert_close(got.cpu().double(), want, atol=tol, rtol=tol)


# (N, K): rows and columns that are not multiples of the blocks, and exact ones.
SHAPES_CPU = [(40, 200), (64, 128), (5, 72)]
SHAPES_CUDA = [(6144, 4096), (4096, 14336), (1000, 999)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [False, True, "act"])
@pytest.mark.parametrize("extras", ["none", "bias", "residual", "both"])
def test_gemv_matches_fp32_math(dtype, norm, extras):
    gemv = _kernels()[0]
    gen = torch.Generator().manual_seed(hash((str(dtype), norm, extras)) % 2**31)
    shapes = SHAPES_CUDA if DEVICE == "cuda" else SHAPES_CPU
    # Small blocks on the CPU so the K loop and the masks run more than once.
    config = None if DEVICE == "cuda" else gemv.GemvConfig(block_n=8, block_k=32, num_warps=2)
    for n, k in shapes:
        check_fused(functools.partial(gemv.gemv, config=config), gen, 1, n, k, dtype, norm, extras)


# (M, N, K) for the batch version: row and column counts off the tiles, and exact ones.
ROWS_SHAPES_CPU = [(3, 40, 100), (20, 32, 64), (1, 24, 40)]
ROWS_SHAPES_CUDA = [(214, 4096, 1024), (77, 1024, 3072), (256, 6144, 1024), (5, 1000, 999)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [False, True, "act"])
@pytest.mark.parametrize("extras", ["none", "bias", "residual", "both"])
@pytest.mark.parametrize("split_k", [1, 3])
def test_rows_gemm_matches_fp64_math(dtype, norm, extras, split_k):
    rows = _kernels()[1]
    gen = torch.Generator().manual_seed(hash(("rows", str(dtype), norm, extras)) % 2**31)
    shapes = ROWS_SHAPES_CUDA if DEVICE == "cuda" else ROWS_SHAPES_CPU
    # Small tiles on the CPU so that the K loop and the row / column masks run; K in slices
    # (a second kernel sums them) with split_k.
    if DEVICE == "cuda":
        config = None if split_k == 1 else rows.RowsGemmConfig(64, 64, 64, 4, 3, split_k)
    else:
        config = rows.RowsGemmConfig(16, 16, 16, 2, 2, split_k)
    for m, n, k in shapes:
        fused = functools.partial(rows.rows_gemm, config=config)
        check_fused(fused, gen, m, n, k, dtype, norm, extras, bf16_tol=3e-2)


def test_rows_gemm_reads_strided_rows_and_weights():
    """Rows of a wider buffer (a view with a row stride above K), as the layers hand them."""
    rows = _kernels()[1]
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(24, 40, generator=gen)
    wide = torch.randn(5, 64, generator=gen)
    x = wide[:, 8:48]
    cfg = rows.RowsGemmConfig(16, 16, 16, 2, 2)
    got = rows.rows_gemm(x.to(DEVICE), w.to(DEVICE), config=cfg)
    torch.testing.assert_close(got.cpu(), x @ w.t(), atol=1e-5, rtol=1e-5)
    # and a weight whose memory is [K, N] (the CPU layers' layout)
    got = rows.rows_gemm(x.to(DEVICE), w.t().contiguous().t().to(DEVICE), config=cfg)
    torch.testing.assert_close(got.cpu(), x @ w.t(), atol=1e-5, rtol=1e-5)


def test_gemv_supported_rejects_what_it_cannot_run():
    from minisgl.kernels.gemv import gemv_supported

    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    assert gemv_supported(torch.zeros(1, 16, dtype=torch.bfloat16), w)
    assert not gemv_supported(torch.zeros(2, 16, dtype=torch.bfloat16), w)  # two rows
    assert not gemv_supported(torch.zeros(1, 16, dtype=torch.float16), w)  # dtype mismatch
    assert not gemv_supported(torch.zeros(1, 16, dtype=torch.int32), w.int())  # not a float


def test_gemv_reads_a_column_major_weight():
    """A weight whose memory is [K, N] (the CPU layers' layout) gives the same result."""
    gemv = _kernels()[0]
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(24, 40, generator=gen)
    x = torch.randn(1, 40, generator=gen)
    cfg = gemv.GemvConfig(block_n=8, block_k=16, num_warps=2)
    got = gemv.gemv(x.to(DEVICE), w.t().contiguous().t().to(DEVICE), config=cfg)
    torch.testing.assert_close(got.cpu(), x @ w.t(), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_gemv_compiles_for_sm90_without_spills():
    from sm90 import run_compile_script

    results = run_compile_script(__file__)
    assert len(results) == len(COMPILE) + len(COMPILE_ROWS)
    spilled = [r for r in results if r["local"] > 0]
    assert not spilled, f"register spills: {spilled}"


# (name, constexprs, warps) compiled for sm_90 by the test above.
COMPILE = [
    ("bf16 plain 16x512 w4", dict(NORM=False, HAS_RES=False, BLOCK_N=16, BLOCK_K=512), 4),
    ("bf16 norm 16x256 w4", dict(NORM=True, HAS_RES=False, BLOCK_N=16, BLOCK_K=256), 4),
    ("bf16 residual 32x512 w8", dict(NORM=False, HAS_RES=True, BLOCK_N=32, BLOCK_K=512), 8),
    ("bf16 norm 4x256 w4", dict(NORM=True, HAS_RES=False, BLOCK_N=4, BLOCK_K=256), 4),
    ("bf16 norm 2x2048 w8", dict(NORM=True, HAS_RES=False, BLOCK_N=2, BLOCK_K=2048), 8),
    ("bf16 act residual 8x1024 w4", dict(NORM=False, ACT=True, HAS_RES=True, BLOCK_N=8, BLOCK_K=1024), 4),
]  # fmt: skip


# (name, constexprs, warps, stages) of the batch version.
COMPILE_ROWS = [
    ("rows bf16 norm 64x64x64 w4 s3", dict(NORM=True, HAS_RES=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64), 4, 3),
    ("rows bf16 residual 64x32x64 w4 s4", dict(NORM=False, HAS_RES=True, BLOCK_M=64, BLOCK_N=32, BLOCK_K=64), 4, 4),
    ("rows bf16 act residual 32x32x128 w4 s3", dict(NORM=False, ACT=True, HAS_RES=True, BLOCK_M=32, BLOCK_N=32, BLOCK_K=128), 4, 3),
    ("rows bf16 norm 128x64x64 w8 s3", dict(NORM=True, HAS_RES=False, BLOCK_M=128, BLOCK_N=64, BLOCK_K=64), 8, 3),
    ("rows bf16 plain 16x64x128 w4 s4", dict(NORM=False, HAS_RES=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128), 4, 4),
    ("rows bf16 norm split 4 64x64x64 w4 s3", dict(NORM=True, HAS_RES=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, SPLIT_K=4), 4, 3),
]  # fmt: skip


def _compile_all() -> list[dict[str, object]]:
    from sm90 import compile_sm90

    from minisgl.kernels.gemv import _gemv_kernel
    from minisgl.kernels.rows_gemm import _rows_gemm_kernel

    out = []
    for name, c, warps in COMPILE:
        types = {n: "*bf16" for n in ("x_ptr", "w_ptr", "y_ptr", "b_ptr", "r_ptr", "g_ptr")}
        types |= {"eps": "fp32"}
        c = c | dict(HAS_BIAS=False, PRELOAD=True, stride_wk=1)
        c.setdefault("ACT", False)
        aligned = ["x_ptr", "w_ptr", "y_ptr", "stride_wn", "K"]
        out.append({"name": name, **compile_sm90(_gemv_kernel, types, c, warps, None, aligned)})
    for name, c, warps, stages in COMPILE_ROWS:
        types = {n: "*bf16" for n in ("x_ptr", "w_ptr", "y_ptr", "b_ptr", "r_ptr", "g_ptr")}
        types |= {"part_ptr": "*fp32", "ss_ptr": "*fp32", "eps": "fp32"}
        c = dict(SPLIT_K=1) | c | dict(HAS_BIAS=False, IEEE=False, EMULATE_BF16=False)
        c |= dict(NUM_STAGES=stages, stride_wk=1)
        c.setdefault("ACT", False)
        aligned = [
            "x_ptr",
            "w_ptr",
            "y_ptr",
            "r_ptr",
            "stride_xm",
            "stride_wn",
            "K",
            "N",
            "K_SPLIT",
        ]
        out.append(
            {"name": name, **compile_sm90(_rows_gemm_kernel, types, c, warps, stages, aligned)}
        )
    return out


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for result in _compile_all():
        print(json.dumps(result))
