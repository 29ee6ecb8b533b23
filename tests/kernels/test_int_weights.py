"""The integer-weight GEMV and GEMM (`minisgl.kernels.lowbit.triton`) against the dequantized
weight in fp64 torch. Without CUDA they run in Triton's CPU interpreter (small shapes)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed (optional dependency 'gpu')")

from minisgl.kernels.lowbit import QWeight, quantize_rtn  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (N, K): a ragged N; on CUDA the Llama-3-8B decoder shapes.
SHAPES = [(40, 256), (64, 128)] if DEVICE == "cpu" else [(6144, 4096), (4096, 14336), (1000, 1024)]  # fmt: skip


def _kernels():
    from minisgl.kernels.common import is_interpreted
    from minisgl.kernels.lowbit import triton as lowbit_triton

    if DEVICE == "cpu" and not is_interpreted(lowbit_triton._gemv_kernel):
        pytest.skip("minisgl.kernels was imported before TRITON_INTERPRET=1 was set")
    return lowbit_triton


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize(("bits", "group"), [(4, 32), (4, 128), (8, 16), (8, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_dequantized_weight(rows, bits, group, bias):
    lowbit = _kernels()
    gen = torch.Generator().manual_seed(rows * 1000 + bits * 100 + group)
    for n, k in SHAPES:
        w = quantize_rtn(torch.randn(n, k, generator=gen) * 0.05, bits, group)
        # fp16 scales and mins, as the kernels store them
        w = w._replace(scales=w.scales.half().float(), mins=w.mins.half().float())
        w = QWeight(*(t.to(DEVICE) for t in w[:3]))
        x = torch.randn(rows, k, generator=gen).to(DEVICE, torch.bfloat16)
        b = torch.randn(n, generator=gen).to(DEVICE, torch.bfloat16) if bias else None
        y = lowbit.TritonLowBit.pack(w)(x, b)
        ref = x.double() @ w.dequantize().double().T + (0 if b is None else b.double())
        # bf16 weights in the GEMM's tiles and a bf16 output: 2^-8 of the terms' magnitudes
        scale = x.abs().double() @ w.dequantize().abs().double().T + 1
        assert y.dtype == torch.bfloat16
        assert ((y.double() - ref).abs() <= 8e-3 * scale).all(), (y.double() - ref).abs().max()


def test_desc_act_permutation_gathers_x():
    lowbit = _kernels()
    gen = torch.Generator().manual_seed(5)
    n, k = SHAPES[0]
    w = quantize_rtn(torch.randn(n, k, generator=gen), 4, 32)
    w = w._replace(scales=w.scales.half().float(), mins=w.mins.half().float())
    w = QWeight(*(t.to(DEVICE) for t in w[:3]), torch.randperm(k, generator=gen).to(DEVICE))
    x = torch.randn(2, k, generator=gen).to(DEVICE, torch.bfloat16)
    ref = x.double() @ w.dequantize().double().T  # dequantize() undoes the permutation
    scale = x.abs().double() @ w.dequantize().abs().double().T + 1
    assert ((lowbit.TritonLowBit.pack(w)(x).double() - ref).abs() <= 8e-3 * scale).all()
