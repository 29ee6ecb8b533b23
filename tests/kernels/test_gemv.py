"""The batch-1 GEMV kernel against torch's matmul in fp32 (without CUDA, in Triton's CPU
interpreter, which runs bf16 / fp16 loads as well)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed (optional dependency 'gpu')")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _gemv():
    from minisgl.kernels import gemv
    from minisgl.kernels.common import is_interpreted

    if DEVICE == "cpu" and not is_interpreted(gemv._gemv_kernel):
        pytest.skip("minisgl.kernels was imported before TRITON_INTERPRET=1 was set")
    return gemv


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k", "bias"), [(96, 256, False), (100, 200, True), (7, 1000, False)])
@pytest.mark.parametrize("config", [None, (8, 128, 2, 1), (32, 64, 4, 3)])
def test_gemv_matches_fp32_matmul(dtype, n, k, bias, config):
    g = _gemv()
    gen = torch.Generator().manual_seed(n * k)
    x = torch.randn(1, k, generator=gen).to(dtype).to(DEVICE)
    w = torch.randn(n, k, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    cfg = None if config is None else g.GemvConfig(*config)
    got = g.gemv(x, w, b, config=cfg)
    ref = x.float() @ w.float().T + (b.float() if b is not None else 0)
    assert got.shape == (1, n) and got.dtype == dtype
    # fp32 accumulation: the only error is the final rounding to 16 bits.
    torch.testing.assert_close(got.float(), ref, atol=2e-2 * k**0.5 / 16, rtol=1e-2)


def test_gemv_strided_weight_rows():
    """A weight view with padded rows (a slice of a wider matrix) is read through its stride."""
    g = _gemv()
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(64, 300, generator=gen).to(torch.bfloat16).to(DEVICE)
    w = wide[:, :256]
    x = torch.randn(1, 256, generator=gen).to(torch.bfloat16).to(DEVICE)
    assert g.gemv_supported(x, w)
    torch.testing.assert_close(g.gemv(x, w).float(), x.float() @ w.float().T, atol=0.1, rtol=1e-2)


def test_gemv_not_taken_for_batches_or_fp32():
    g = _gemv()
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    assert not g.gemv_supported(torch.zeros(2, 16, dtype=torch.bfloat16), w)
    assert not g.gemv_supported(torch.zeros(1, 16), w.float())
    assert not g.gemv_supported(torch.zeros(1, 16, dtype=torch.bfloat16), w.T)
