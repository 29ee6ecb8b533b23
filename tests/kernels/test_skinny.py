"""The skinny GEMM (`minisgl.kernels.gemv.skinny`: 1..16 rows of x on tensor cores) with its fused
prologues / epilogues, FP8 weights and split-K, against fp64 torch math on the same values.
Without CUDA it runs in Triton's CPU interpreter (tiny shapes); the sm_90 compile check runs the
real compiler without a GPU.

Tolerances, from the roundings. In bf16 the kernel rounds the tensor-core operand x (after the
norm or SiLU) to bf16, 2^-9 relative per element, so a sum moves by at most 2^-9 sum|w x|; the
output is rounded once more (2^-9 |y|); fp32 sums add next to nothing. The check allows twice
each (`_assert_close`); a lost row, split, scale or fusion is off by far more. e4m3 weights are
compared against the values they stand for (e4m3 value x scale, exact in fp64), so e4m3's own
rounding (2^-4) does not enter: the same bound. fp32 operands: 1e-5 in place of 2^-8."""

from __future__ import annotations

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
ROWS = [1, 2, 5, 9, 16]


def _skinny_module():
    from minisgl.kernels.common import is_interpreted
    from minisgl.kernels.gemv import skinny

    if DEVICE == "cpu" and not is_interpreted(skinny._skinny_kernel):
        pytest.skip("minisgl.kernels was imported before TRITON_INTERPRET=1 was set")
    return skinny


def _reference(x, w, bias, residual, norm_weight, eps, act=False):
    """(y, the bound `_assert_close` allows from bf16 roundings: sum|w x'| + |y|) in fp64."""
    xf = x.double()
    if act:
        gate, up = xf.chunk(2, dim=-1)
        xf = F.silu(gate) * up
    if norm_weight is not None:
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    y = xf @ w.double().t()
    scale = xf.abs() @ w.double().abs().t()
    if bias is not None:
        y = y + bias.double()
    if residual is not None:
        y = y + residual.double()
    return y, scale + y.abs()


def _assert_close(got, want, dtype):
    y, scale = want
    rel = 1e-5 if dtype == torch.float32 else 2.0**-8
    err = (got.cpu().double() - y).abs()
    worst = (err - rel * scale).max().item()
    assert worst <= 1e-6, f"error {err.max().item():.3g} over the rounding bound by {worst:.3g}"


def _inputs(gen, m, n, k, dtype, fusion):
    act = fusion.startswith("act")
    x = (torch.randn(m, 2 * k if act else k, generator=gen) * 2).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if "bias" in fusion else None
    res = torch.randn(m, n, generator=gen).to(dtype) if "residual" in fusion else None
    g = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype) if "norm" in fusion else None
    return x, bias, res, g, act


FUSIONS = ["plain", "bias", "norm+bias", "act+residual", "norm+residual"]


# bf16 at every row count; fp32 (exact operands: it checks the indexing tightly) at two.
CASES = [(torch.bfloat16, f, m) for f in FUSIONS for m in ROWS]
CASES += [(torch.float32, f, m) for f in FUSIONS for m in (2, 9)]


@pytest.mark.parametrize(("dtype", "fusion", "m"), CASES)
def test_skinny_matches_fp64_math(dtype, fusion, m):
    """Odd N and K (masked tiles and K steps), unsplit and split over K (with an empty split:
    5 K steps in 4 splits of 2)."""
    sk = _skinny_module()
    gen = torch.Generator().manual_seed(hash((str(dtype), fusion, m)) % 2**31)
    n, k = (45, 151) if DEVICE == "cpu" else (6144, 4095)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    x, bias, res, g, act = _inputs(gen, m, n, k, dtype, fusion)
    want = _reference(x, w, bias, res, g, 1e-5, act)
    dev = [None if t is None else t.to(DEVICE) for t in (x, w, bias, res, g)]
    for split in (1, 4):
        cfg = sk.SkinnyConfig(block_n=16, block_k=32, num_warps=2, num_stages=2, split_k=split)
        got = sk.skinny(
            dev[0], dev[1], bias=dev[2], residual=dev[3], norm_weight=dev[4], eps=1e-5, act=act,
            config=cfg if DEVICE == "cpu" else None,
        )  # fmt: skip
        assert got.shape == (m, n) and got.dtype == dtype
        _assert_close(got, want, dtype)


@pytest.mark.parametrize("layout", ["row", "block"])
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("fusion", ["plain", "norm+bias", "act+residual"])
def test_skinny_fp8_weights_match_their_dequantized_values(layout, m, fusion):
    """e4m3 weights with a scale per row or per 128 x 128 block (ragged blocks on the CPU),
    widened in the kernel; block scales per 128-column K step, split over K too."""
    from minisgl.kernels.fp8 import dequantize_weight, quantize_blocks, quantize_rows

    sk = _skinny_module()
    gen = torch.Generator().manual_seed(hash((layout, m, fusion)) % 2**31)
    n, k = (151, 301) if DEVICE == "cpu" else (6143, 4096)
    w = torch.randn(n, k, generator=gen) / k**0.5 * torch.logspace(-1, 1, n)[:, None]
    q, scale = quantize_rows(w) if layout == "row" else quantize_blocks(w)
    w_deq = dequantize_weight(q, scale, None if layout == "row" else 128, torch.float32)
    x, bias, res, g, act = _inputs(gen, m, n, k, torch.bfloat16, fusion)
    want = _reference(x, w_deq, bias, res, g, 1e-5, act)
    dev = [None if t is None else t.to(DEVICE) for t in (x, q, bias, res, g, scale)]
    for split in (1, 2):
        cfg = sk.SkinnyConfig(block_n=32, block_k=128, num_warps=4, num_stages=2, split_k=split)
        got = sk.skinny(
            dev[0], dev[1], bias=dev[2], residual=dev[3], norm_weight=dev[4], eps=1e-5, act=act,
            config=cfg if DEVICE == "cpu" else None, weight_scale=dev[5],
        )  # fmt: skip
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        _assert_close(got, want, torch.bfloat16)


def test_skinny_rows_are_independent_and_splits_leave_no_trace():
    """Each row of a 16-row call equals that row alone (fp32), and a split call leaves its
    counters at zero (as a CUDA-graph replay needs them) and repeats exactly."""
    from minisgl.kernels.common import split_counters

    sk = _skinny_module()
    gen = torch.Generator().manual_seed(4)
    w, x = torch.randn(24, 72, generator=gen), torch.randn(16, 72, generator=gen)
    r = torch.randn(16, 24, generator=gen)
    cfg = sk.SkinnyConfig(block_n=16, block_k=16, num_warps=2, num_stages=2, split_k=3)
    dev = [t.to(DEVICE) for t in (x, w, r)]
    both = sk.skinny(dev[0], dev[1], residual=dev[2], config=cfg)
    assert int(split_counters(dev[0].device, 2)[:2].abs().sum()) == 0
    again = sk.skinny(dev[0], dev[1], residual=dev[2], config=cfg)
    torch.testing.assert_close(again, both, atol=0, rtol=0)
    for i in (0, 7, 15):
        one = sk.skinny(dev[0][i : i + 1], dev[1], residual=dev[2][i : i + 1], config=cfg)
        torch.testing.assert_close(both[i : i + 1], one, atol=1e-6, rtol=1e-6)


def test_skinny_reads_a_column_major_weight():
    """A weight whose memory is [K, N] (the CPU layers' layout) gives the same result."""
    sk = _skinny_module()
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(24, 40, generator=gen), torch.randn(3, 40, generator=gen)
    cfg = sk.SkinnyConfig(block_n=16, block_k=16, num_warps=2, num_stages=2)
    got = sk.skinny(x.to(DEVICE), w.t().contiguous().t().to(DEVICE), config=cfg)
    torch.testing.assert_close(got.cpu(), x @ w.t(), atol=1e-5, rtol=1e-5)


def test_skinny_supported_rejects_what_it_cannot_run():
    from minisgl.kernels.gemv.skinny import skinny_supported

    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    assert skinny_supported(torch.zeros(16, 16, dtype=torch.bfloat16), w)
    assert skinny_supported(torch.zeros(5, 16, dtype=torch.bfloat16), w.to(torch.float8_e4m3fn))
    assert not skinny_supported(torch.zeros(17, 16, dtype=torch.bfloat16), w)  # over 16 rows
    assert not skinny_supported(torch.zeros(5, 16, dtype=torch.bfloat16), w, max_rows=4)
    assert not skinny_supported(torch.zeros(0, 16, dtype=torch.bfloat16), w)
    assert not skinny_supported(torch.zeros(2, 16, dtype=torch.float16), w)  # dtype mismatch


def test_default_configs_fit_the_kernel():
    """The guessed defaults: tiles tl.dot takes, K steps of 128 (block-scaled FP8 needs them),
    splits only where the tiles alone leave SMs idle."""
    from minisgl.kernels.gemv.skinny import FORMATS, TUNED, default_config

    for n, k in [(5120, 2048), (2048, 12288), (24576, 2048), (100352, 2048), (960, 576)]:
        assert (n, k, False, "bf16") not in TUNED
        cfg = default_config(n, k)
        assert cfg.block_n >= 16 and cfg.block_k == 128 and cfg.split_k >= 1
        assert default_config(n, k, fmt="block").block_k == 128
        tiles = -(-n // cfg.block_n)
        assert cfg.split_k == 1 or tiles < 2 * 132
    assert default_config(100352, 2048).split_k == 1
    for (n, k, _, fmt), cfg in TUNED.items():  # pasted from the H200 sweep
        assert fmt in FORMATS and cfg.block_n >= 16 and cfg.block_k >= 16 and cfg.split_k >= 1
        assert fmt != "block" or cfg.block_k == 128, f"{(n, k)}: block scales take 128 columns"


@pytest.mark.slow
def test_skinny_compiles_for_sm90_without_spills():
    from sm90 import run_compile_script

    results = run_compile_script(__file__)
    assert len(results) == len(COMPILE)
    spilled = [r for r in results if r["local"] > 0]
    assert not spilled, f"register spills: {spilled}"


# (name, constexprs, warps, stages) compiled for sm_90 by the test above.
COMPILE = [
    ("bf16 plain 64x128 w4 s4", dict(BLOCK_N=64, BLOCK_K=128), 4, 4),
    ("bf16 norm 32x128 w4 s4 split", dict(NORM=True, BLOCK_N=32, BLOCK_K=128, SPLIT_K=2), 4, 4),
    ("bf16 residual 128x128 w8 s3", dict(HAS_RES=True, BLOCK_N=128, BLOCK_K=128), 8, 3),
    ("bf16 act residual 32x256 w4 s3", dict(ACT=True, HAS_RES=True, BLOCK_N=32, BLOCK_K=256), 4, 3),
    ("bf16 norm bias 64x64 w4 s6", dict(NORM=True, HAS_BIAS=True, BLOCK_N=64, BLOCK_K=64), 4, 6),
    ("fp8 row norm 64x256 w4 s4", dict(NORM=True, BLOCK_N=64, BLOCK_K=256, W_SCALE=1), 4, 4),
    ("fp8 row act residual 64x256 w4 s4 split", dict(ACT=True, HAS_RES=True, BLOCK_N=64, BLOCK_K=256, W_SCALE=1, SPLIT_K=4), 4, 4),
    ("fp8 block norm 64x128 w4 s4", dict(NORM=True, BLOCK_N=64, BLOCK_K=128, W_SCALE=2), 4, 4),
    ("fp8 block act residual 128x128 w8 s4 split", dict(ACT=True, HAS_RES=True, BLOCK_N=128, BLOCK_K=128, W_SCALE=2, SPLIT_K=2), 8, 4),
]  # fmt: skip


def _compile_all() -> list[dict[str, object]]:
    from sm90 import compile_sm90

    from minisgl.kernels.gemv.skinny import BLOCK_M, _skinny_kernel

    out = []
    for name, c, warps, stages in COMPILE:
        types = {n: "*bf16" for n in ("x_ptr", "w_ptr", "y_ptr", "b_ptr", "r_ptr", "g_ptr")}
        types |= {"eps": "fp32", "s_ptr": "*fp32", "part_ptr": "*fp32", "ss_ptr": "*fp32"}
        types |= {"counter_ptr": "*i32"}
        if c.get("W_SCALE"):
            types["w_ptr"] = "*fp8e4nv"
        base = dict(HAS_BIAS=False, HAS_RES=False, NORM=False, ACT=False, W_SCALE=0, SPLIT_K=1)
        fixed = dict(IEEE=False, EMULATE_BF16=False, BLOCK_M=BLOCK_M, stride_wk=1)
        aligned = ["x_ptr", "w_ptr", "y_ptr", "stride_xm", "stride_wn", "K", "N"]
        compiled = compile_sm90(_skinny_kernel, types, base | c | fixed, warps, stages, aligned)
        out.append({"name": name, **compiled})
    return out


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for result in _compile_all():
        print(json.dumps(result))
