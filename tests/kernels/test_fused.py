"""Fused elementwise kernels (RMSNorm + residual, rotary, SiLU-and-mul) against the torch
layers they replace on CUDA. Without CUDA they run in Triton's CPU interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed (optional dependency 'gpu')")

from minisgl.config import RopeConfig  # noqa: E402
from minisgl.layers import RMSNorm, RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 matches to rounding; bf16 within a couple of bf16 ulps (the interpreter rounds bf16
# casts its own way, and the reduction order differs).
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
TOL_KW = {d: {"atol": a, "rtol": r} for d, (a, r) in TOL.items()}


def _fused():
    from minisgl.kernels import fused
    from minisgl.kernels.common import is_interpreted

    if DEVICE == "cpu" and not is_interpreted(fused._rms_norm_kernel):
        pytest.skip("minisgl.kernels was imported before TRITON_INTERPRET=1 was set")
    return fused


def _ref_layers(module: torch.nn.Module, fn, *args):
    """Run the torch reference of a layer (on the CPU, where layers never fuse)."""
    cpu_args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    return fn(module.cpu(), *cpu_args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_and_without_residual(dtype):
    fused = _fused()
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-6)
    norm.weight.data = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype)
    x = (torch.randn(7, 96, generator=gen) * 3).to(dtype)
    res = torch.randn(7, 96, generator=gen).to(dtype)
    atol, rtol = TOL[dtype]
    for residual in (None, res):
        want_out, want_res = _ref_layers(norm, lambda m, a, r: m(a, r), x, residual)
        got_out, got_res = fused.rms_norm(
            x.to(DEVICE), norm.weight.to(DEVICE), 1e-6, None if residual is None else res.to(DEVICE)
        )
        torch.testing.assert_close(got_out.cpu(), want_out, atol=atol, rtol=rtol)
        # The residual sum is one rounding: exact, except that the interpreter truncates bf16.
        exact = DEVICE == "cuda" or dtype == torch.float32
        torch.testing.assert_close(
            got_res.cpu(), want_res, **({"atol": 0, "rtol": 0} if exact else TOL_KW[dtype])
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_of_heads_in_a_fused_projection(dtype):
    fused = _fused()
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, 4 * 32 + 2 * 2 * 32, generator=gen).to(dtype)
    q = qkv[:, : 4 * 32].view(5, 4, 32)  # strided rows, like the model's q
    norm = RMSNorm(32, 1e-6)
    norm.weight.data = (1 + 0.1 * torch.randn(32, generator=gen)).to(dtype)
    want = norm.norm(q)
    got = fused.rms_norm(q.to(DEVICE), norm.weight.to(DEVICE), 1e-6)[0]
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.cpu(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_norm", [False, True], ids=["rope", "norm+rope"])
def test_qk_norm_rope_with_strided_positions_and_heads(dtype, with_norm):
    fused = _fused()
    gen = torch.Generator().manual_seed(2)
    rope = RotaryEmbedding(64, 256, RopeConfig(theta=10000.0))
    qkv = (torch.randn(6, (4 + 2 + 2) * 64, generator=gen) * 2).to(dtype)
    q = qkv[:, : 4 * 64].view(6, 4, 64)  # strided rows, like the model's q and k
    k = qkv[:, 4 * 64 : 6 * 64].view(6, 2, 64)
    packed = torch.tensor([[3, 17, 0], [0, 200, 1], [1, 5, 2], [2, 255, 3], [9, 0, 4], [4, 64, 5]])
    positions = packed[:, 1]  # a strided column, like the CUDA-graph inputs
    norms = [None, None]
    if with_norm:
        norms = [RMSNorm(64, 1e-6), RMSNorm(64, 1e-6)]
        for n in norms:
            n.weight.data = (1 + 0.2 * torch.randn(64, generator=gen)).to(dtype)
    want_q, want_k = rope(positions, q, k, *norms)
    table = rope.cos_sin.to(DEVICE)
    weights = [None if n is None else n.weight.to(DEVICE) for n in norms]
    got_q, got_k = fused.qk_norm_rope(
        positions.to(DEVICE), q.to(DEVICE), k.to(DEVICE), table, *weights, eps=1e-6
    )
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got_q.cpu(), want_q, atol=atol, rtol=rtol)
    torch.testing.assert_close(got_k.cpu(), want_k, atol=atol, rtol=rtol)

    # With a KV store: the rotated k and the new v land in the pool at their slots (v exactly),
    # nothing else in the pool changes, and q is the same.
    v = qkv[:, 6 * 64 :].view(6, 2, 64)
    k_cache = torch.zeros(20, 2, 64, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    loc = torch.tensor([7, 0, 19, 3, 12, 8], device=DEVICE)
    q2, k2 = fused.qk_norm_rope(
        positions.to(DEVICE), q.to(DEVICE), k.to(DEVICE), table, *weights, eps=1e-6,
        v=v.to(DEVICE), store=(k_cache, v_cache, loc),
    )  # fmt: skip
    assert k2 is None
    torch.testing.assert_close(q2.cpu(), got_q.cpu(), atol=0, rtol=0)
    torch.testing.assert_close(k_cache[loc].cpu(), got_k.cpu(), atol=0, rtol=0)
    torch.testing.assert_close(v_cache[loc].cpu(), v, atol=0, rtol=0)
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[loc.cpu()] = False
    assert not k_cache.cpu()[untouched].any() and not v_cache.cpu()[untouched].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_stores_into_an_fp8_pool(dtype):
    """Into an e4m3 pool, the rotated k (rounded to the model dtype first, as unfused) minus the
    key shift, and v, are divided by their head's scale: the same bytes as `quantize_kv` of the
    unfused results."""
    from minisgl.kernels.fp8 import quantize_kv, v_pages, v_rows

    fused = _fused()
    gen = torch.Generator().manual_seed(5)
    rope = RotaryEmbedding(64, 256, RopeConfig(theta=10000.0))
    qkv = (torch.randn(6, 8 * 64, generator=gen) * 40).to(dtype)  # beyond 448 / scale: clamped
    q, k, v = (
        qkv[:, :256].view(6, 4, 64),
        qkv[:, 256:384].view(6, 2, 64),
        qkv[:, 384:].view(6, 2, 64),
    )
    positions = torch.tensor([3, 200, 5, 255, 0, 64])
    norms = [RMSNorm(64, 1e-6), RMSNorm(64, 1e-6)]
    scales = (torch.tensor([0.004, 0.5]), torch.tensor([0.25, 0.02]))
    k_cache = torch.zeros(20, 2, 64, dtype=torch.float8_e4m3fn, device=DEVICE)
    v_cache = v_pages(torch.zeros_like(k_cache), 4)  # the FP8 pool's V: pages [Hkv, D, 4]
    loc = torch.tensor([7, 0, 19, 3, 12, 8], device=DEVICE)
    table = rope.cos_sin.to(DEVICE)
    shift = torch.randn(2, 64, generator=gen)
    fused.qk_norm_rope(
        positions.to(DEVICE), q.to(DEVICE), k.to(DEVICE), table,
        *[n.weight.to(DEVICE, dtype) for n in norms], eps=1e-6, v=v.to(DEVICE),
        store=(k_cache, v_cache, loc), kv_scales=tuple(s.to(DEVICE) for s in scales),
        k_shift=shift.to(DEVICE),
    )  # fmt: skip
    _, want_k = fused.qk_norm_rope(
        positions.to(DEVICE), q.to(DEVICE), k.to(DEVICE), table,
        *[n.weight.to(DEVICE, dtype) for n in norms], eps=1e-6,
    )  # fmt: skip
    got_k, got_v = k_cache[loc].cpu().float(), v_rows(v_cache, loc).cpu().float()
    assert torch.isfinite(got_k).all() and got_k.abs().max() == 448  # some values saturated
    assert torch.equal(got_k, quantize_kv(want_k.cpu(), scales[0], shift).float())
    assert torch.equal(got_v, quantize_kv(v, scales[1]).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    from minisgl.layers import silu_and_mul

    fused = _fused()
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(9, 2 * 1500, generator=gen) * 2).to(dtype)
    want = silu_and_mul(x)
    got = fused.silu_and_mul(x.to(DEVICE))
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.cpu(), want, atol=atol, rtol=rtol)
