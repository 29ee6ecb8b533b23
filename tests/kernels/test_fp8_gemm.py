"""FP8 GEMMs for linear layers (`minisgl.kernels.fp8.gemm`): per-token activation quantization
against `minisgl.kernels.fp8`, the Triton FP8 GEMM (per-channel and 128 x 128 block weight
scales) against fp64 math on the dequantized operands, and `fp8_linear`'s two routes. Without
CUDA the kernels run in Triton's CPU interpreter; the sm_90 compile runs in a subprocess."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

COMPILE_MODE = __name__ == "__main__"
if not torch.cuda.is_available() and not COMPILE_MODE:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed (optional dependency 'gpu')")

from minisgl.kernels import fp8 as R  # noqa: E402
from minisgl.kernels.common import is_interpreted  # noqa: E402
from minisgl.kernels.fp8 import gemm as G  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not COMPILE_MODE and not is_interpreted(G._fp8_gemm_kernel):
    pytest.skip("minisgl.kernels was imported before TRITON_INTERPRET=1", allow_module_level=True)

SMALL = G.Fp8GemmConfig(block_m=16, block_n=32, block_k=128, num_warps=2, num_stages=1)


@pytest.mark.parametrize("group", [None, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantization_matches_the_reference(group, dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 300, generator=gen) * torch.logspace(-2, 2, 5)[:, None]).to(dtype)
    x[2] = 0  # an all-zero row gets a tiny scale, not NaN
    q, s = G.quantize_activations(x.to(DEVICE), group)
    if group is None:
        want_q, want_s = R.quantize_activations(x)
    else:  # per 128 columns: each group on its own
        parts = [R.quantize_activations(x[:, i : i + group]) for i in range(0, 300, group)]
        want_q = torch.cat([p[0] for p in parts], dim=1)
        want_s = torch.cat([p[1] for p in parts], dim=1)
    assert q.dtype == torch.float8_e4m3fn and s.shape == want_s.shape
    assert torch.equal(q.cpu().float(), want_q.float())
    torch.testing.assert_close(s.cpu(), want_s, atol=0, rtol=0)


def operands(m: int, n: int, k: int, layout: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * 2
    w = torch.randn(n, k, generator=gen) / k**0.5 * torch.logspace(-1, 1, n)[:, None]
    if layout == "row":
        wq, ws = R.quantize_rows(w)
        xq, xs = R.quantize_activations(x)
        x_deq = xq.float() * xs
    else:
        wq, ws = R.quantize_blocks(w)
        q, xs = G.quantize_activations(x.to(DEVICE), 128)
        xq, xs = q.cpu(), xs.cpu()
        x_deq = xq.float() * xs.repeat_interleave(128, dim=1)[:, :k]
    w_deq = R.dequantize_weight(wq, ws, None if layout == "row" else 128, torch.float32)
    return x, xq, xs, wq, ws, (x_deq.double() @ w_deq.double().t())


@pytest.mark.parametrize("layout", ["row", "block"])
@pytest.mark.parametrize("shape", [(5, 200, 300), (33, 64, 256)])
def test_fp8_gemm_matches_the_dequantized_product(layout, shape):
    m, n, k = shape
    _, xq, xs, wq, ws, want = operands(m, n, k, layout, seed=sum(shape))
    bias = torch.randn(n)
    got = G.fp8_gemm(
        xq.to(DEVICE), xs.to(DEVICE), wq.to(DEVICE), ws.to(DEVICE), torch.float32,
        bias.to(DEVICE), SMALL if DEVICE == "cpu" else None,
    )  # fmt: skip
    err = (got.cpu().double() - (want + bias.double())).abs()
    assert (err <= accumulation_bound(xq, xs, wq, ws, layout)).all(), err.max()


def accumulation_bound(xq, xs, wq, ws, layout: str) -> torch.Tensor:
    """What the summation may cost per output element: fp32 rounding on the CPU; on a GPU,
    Hopper's FP8 MMAs keep about 14 bits of the running sum within a K step (128 columns, summed
    exactly after that), so the error is bounded by 2^-13 of the sum of |products|, with a
    factor 4 of margin (a wrong scale or tile is off by far more)."""
    if DEVICE == "cpu":
        return torch.full((xq.shape[0], wq.shape[0]), 1e-3, dtype=torch.float64)
    if layout == "row":
        x_abs = xq.double().abs() * xs.double()
    else:
        x_abs = xq.double().abs() * xs.double().repeat_interleave(128, dim=1)[:, : xq.shape[1]]
    w_abs = R.dequantize_weight(wq, ws, None if layout == "row" else 128, torch.float32).abs()
    return 1e-3 + 2.0**-11 * (x_abs @ w_abs.double().t())


@pytest.mark.parametrize("layout", ["row", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_quantizes_activations_per_token(layout, dtype):
    """`fp8_linear` end to end: bf16 with per-channel weights takes torch._scaled_mm (on a CPU
    too), the rest the Triton GEMM; both equal the product of the quantized operands."""
    m, n, k = 6, 96, 256
    x, _, _, wq, ws, want = operands(m, n, k, layout, seed=7)
    x = x.to(dtype)
    assert G.scaled_mm_supported(x, wq, ws) == (layout == "row" and dtype == torch.bfloat16)
    got = G.fp8_linear(x.to(DEVICE), wq.to(DEVICE), ws.to(DEVICE))
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    # bf16 activations round before quantization (and the output rounds): relative bounds.
    err = (got.cpu().double() - want).abs().max() / want.abs().max()
    assert err <= tol, err


# ---- compile for sm_90 without a GPU -------------------------------------------------------------

COMPILE = [
    # (name, constexprs, warps, stages)
    ("gemm row m16", dict(W_BLOCK=False, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=128, BLOCK_K=128), 4, 4),
    ("gemm row m128", dict(W_BLOCK=False, HAS_BIAS=True, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128), 8, 3),
    ("gemm block m64", dict(W_BLOCK=True, HAS_BIAS=False, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128), 4, 4),
    ("gemm block m128", dict(W_BLOCK=True, HAS_BIAS=False, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128), 8, 3),
]  # fmt: skip


def _compile_all() -> list[dict[str, object]]:
    from sm90 import compile_sm90

    out = []
    types = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "as_ptr": "*fp32", "bs_ptr": "*fp32"}
    types |= {"c_ptr": "*bf16", "bias_ptr": "*bf16"}
    aligned = ["a_ptr", "b_ptr", "c_ptr", "K", "N", "stride_bn"]
    for name, c, warps, stages in COMPILE:
        c = c | dict(GROUP_M=8, UPCAST=False)
        out.append({"name": name, **compile_sm90(G._fp8_gemm_kernel, types, c, warps, stages, aligned)})  # fmt: skip
    types = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
    for group, block in ((4096, 1024), (128, 128)):
        c = dict(GROUP=group, BLOCK=block, EMULATE_FP8=False)
        result = compile_sm90(G._act_quant_kernel, types, c, 4, None, ["x_ptr", "q_ptr"])
        out.append({"name": f"act quant group {group}", **result})
    return out


@pytest.mark.slow
def test_fp8_gemm_kernels_compile_for_sm90_without_spills():
    from sm90 import run_compile_script

    results = run_compile_script(__file__)
    assert len(results) == len(COMPILE) + 2
    assert not [r for r in results if r["local"] > 0], results


if COMPILE_MODE:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for result in _compile_all():
        print(json.dumps(result))
