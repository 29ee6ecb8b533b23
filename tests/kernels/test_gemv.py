"""The one-row GEMV with its fused prologue / epilogue (`minisgl.kernels.gemv.gemv`) against the same
math in fp32 torch. Without CUDA it runs in Triton's CPU interpreter (small shapes); the sm_90
compile check runs the real compiler without a GPU."""

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


def _gemv_module():
    from minisgl.kernels.common import is_interpreted
    from minisgl.kernels.gemv import gemv

    if DEVICE == "cpu" and not is_interpreted(gemv._gemv_kernel):
        pytest.skip("minisgl.kernels was imported before TRITON_INTERPRET=1 was set")
    return gemv


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


# (N, K): rows and columns that are not multiples of the blocks, and exact ones.
SHAPES_CPU = [(40, 200), (64, 128), (5, 72)]
SHAPES_CUDA = [(6144, 4096), (4096, 14336), (1000, 999)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [False, True, "act"])
@pytest.mark.parametrize("extras", ["none", "bias", "residual", "both"])
def test_gemv_matches_fp32_math(dtype, norm, extras):
    gemv = _gemv_module()
    gen = torch.Generator().manual_seed(hash((str(dtype), norm, extras)) % 2**31)
    shapes = SHAPES_CUDA if DEVICE == "cuda" else SHAPES_CPU
    # Small blocks on the CPU so the K loop and the masks run more than once.
    config = None if DEVICE == "cuda" else gemv.GemvConfig(block_n=8, block_k=32, num_warps=2)
    for n, k in shapes:
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
        act = norm == "act"
        x = (torch.randn(1, 2 * k if act else k, generator=gen) * 2).to(dtype)
        bias = torch.randn(n, generator=gen).to(dtype) if extras in ("bias", "both") else None
        res = torch.randn(1, n, generator=gen).to(dtype) if extras in ("residual", "both") else None
        g = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype) if norm is True else None
        want = _reference(x, w, bias, res, g, 1e-5, act)
        dev = [None if t is None else t.to(DEVICE) for t in (x, w, bias, res, g)]
        got = gemv.gemv(
            dev[0], dev[1], bias=dev[2], residual=dev[3], norm_weight=dev[4], eps=1e-5,
            act=act, config=config,
        )  # fmt: skip
        assert got.shape == (1, n) and got.dtype == dtype
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.cpu().double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("layout", ["row", "block"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("extras", ["plain", "norm+bias", "act+residual"])
def test_gemv_fp8_weights_match_their_dequantized_values(layout, rows, extras):
    """e4m3 weights with a scale per row or per 128 x 128 block, widened in the kernel, against
    fp64 math on the values they stand for; several rows of x (small batches) at once."""
    gemv = _gemv_module()
    gen = torch.Generator().manual_seed(hash((layout, rows, extras)) % 2**31)
    n, k = (300, 260) if DEVICE == "cpu" else (6144, 4096)  # ragged blocks on the CPU
    q, scale, w_deq = _fp8_weight(gen, n, k, layout)
    act = extras.startswith("act")
    dev, want = _fp8_case(gen, q, scale, w_deq, rows, extras)
    config = None if DEVICE == "cuda" else gemv.GemvConfig(block_n=8, block_k=64, num_warps=2)
    got = gemv.gemv(
        dev[0], dev[1], bias=dev[2], residual=dev[3], norm_weight=dev[4], eps=1e-5, act=act,
        config=config, weight_scale=dev[5],
    )  # fmt: skip
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.cpu().double(), want, atol=2e-2, rtol=2e-2)


# One-row FP8 variants in the vec layout (`GemvConfig.layout` "vec"), small tiles
# for the interpreter: e4m3 loads (16 or 8 columns a thread) widened by conversion, int32
# words, partial sums per column, x at its step. "ptx" (inline PTX) runs on CUDA only; here
# it is compiled (`COMPILE_VEC`), and the benchmark checks every variant's result on the GPU.
VEC_VARIANTS = {
    "e4m3 cvt": dict(vec=16),
    "e4m3 cvt keep": dict(vec=16, keep_vec=True),
    "e4m3 8 cvt": dict(vec=8),
    "words cvt": dict(vec=16, words=True),
    "words cvt keep x_at": dict(vec=16, words=True, keep_vec=True, x_ahead=False),
    "words cvt x_at": dict(vec=16, words=True, x_ahead=False),
    "e4m3 cvt keep x_at": dict(vec=16, keep_vec=True, x_ahead=False),
}
if DEVICE == "cuda":
    VEC_VARIANTS["words ptx keep"] = dict(vec=16, words=True, widen="ptx", keep_vec=True)
    VEC_VARIANTS["words ptx"] = dict(vec=16, words=True, widen="ptx")


@pytest.mark.parametrize("variant", list(VEC_VARIANTS))
def test_gemv_fp8_vec_variants(variant):
    """Each one-row FP8 variant, per-row scales with norm + bias and 128 x 128 block scales
    with SiLU + residual, against fp64 math on the values the weights stand for."""
    gemv = _gemv_module()
    gen = torch.Generator().manual_seed(hash(("vec", variant)) % 2**31)
    n, k = (40, 260) if DEVICE == "cpu" else (6144, 4096)  # ragged rows and K, a last word
    kw = VEC_VARIANTS[variant]
    bk = 4 * kw["vec"] if DEVICE == "cpu" else 16 * 32 * 4
    config = gemv.GemvConfig(block_n=8, block_k=bk, num_warps=4, layout="vec", **kw)
    for layout, extras in [("row", "norm+bias"), ("block", "act+residual")]:
        q, scale, w_deq = _fp8_weight(gen, n, k, layout)
        dev, want = _fp8_case(gen, q, scale, w_deq, 1, extras)
        got = gemv.gemv(
            dev[0], dev[1], bias=dev[2], residual=dev[3], norm_weight=dev[4], eps=1e-5,
            act=extras.startswith("act"), config=config, weight_scale=dev[5],
        )  # fmt: skip
        torch.testing.assert_close(got.cpu().double(), want, atol=2e-2, rtol=2e-2)


def _fp8_weight(gen, n, k, layout):
    """An e4m3 [n, k] weight with a scale per row ("row") or per 128 x 128 block, and the fp32
    values it stands for."""
    from minisgl.kernels.fp8 import dequantize_weight, quantize_blocks, quantize_rows

    w = torch.randn(n, k, generator=gen) / k**0.5 * torch.logspace(-1, 1, n)[:, None]
    q, scale = quantize_rows(w) if layout == "row" else quantize_blocks(w)
    return q, scale, dequantize_weight(q, scale, None if layout == "row" else 128, torch.float32)


def _fp8_case(gen, q, scale, w_deq, rows, extras, spread=False):
    """bf16 inputs for `extras` ("plain", "norm+bias", "act+residual", ...) on the device, as
    (x, weight, bias, residual, norm weight, weight scale), and the fp64 reference on `w_deq`;
    with `spread` the rows of x 0.1 to 10 times as large as each other."""
    n, k = q.shape
    act = extras.startswith("act")
    size = torch.logspace(-1, 1, rows)[:, None] if spread else 2
    x = (torch.randn(rows, 2 * k if act else k, generator=gen) * size).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).bfloat16() if "bias" in extras else None
    res = torch.randn(rows, n, generator=gen).bfloat16() if "residual" in extras else None
    g = (1 + 0.1 * torch.randn(k, generator=gen)).bfloat16() if "norm" in extras else None
    want = _reference(x, w_deq, bias, res, g, 1e-5, act)
    return [None if t is None else t.to(DEVICE) for t in (x, q, bias, res, g, scale)], want


@pytest.mark.parametrize("layout", ["row", "block"])
@pytest.mark.parametrize(
    "rows", [2, 5] + [pytest.param(m, marks=pytest.mark.slow) for m in (3, 8, 19)]
)  # (about 1.7 s each in the interpreter; 19: chunks of VEC_MAX_ROWS)
def test_gemv_fp8_vec_layout_takes_several_rows(layout, rows):
    """The vec layout with several rows of x in one program (what an FP8 layer's weight-only
    rows take with `fp8_gemv_max_rows` above 1 at the `TUNED_FP8` shapes), per-row or 128 x 128
    block scales, each fusion once; rows of different sizes, so a per-row rstd that mixed the
    rows up would show, against fp64 math on the values the weights stand for."""
    gemv = _gemv_module()
    gen = torch.Generator().manual_seed(hash(("vec rows", layout, rows)) % 2**31)
    n, k = (136, 260) if DEVICE == "cpu" else (6144, 4096)  # ragged rows, K and blocks on the CPU
    q, scale, w_deq = _fp8_weight(gen, n, k, layout)
    # CUDA: the shape's tuned config (PTX widening); the interpreter: words widened by conversion.
    config = None
    if DEVICE == "cpu":
        config = gemv.GemvConfig(block_n=16, block_k=128, num_warps=4, layout="vec", vec=16,
                                 words=True, keep_vec=rows % 2 == 0, x_ahead=rows != 5)  # fmt: skip
    for extras in ["plain", "norm+bias", "act+residual"]:
        dev, want = _fp8_case(gen, q, scale, w_deq, rows, extras, spread=True)
        got = gemv.gemv(
            dev[0], dev[1], bias=dev[2], residual=dev[3], norm_weight=dev[4], eps=1e-5,
            act=extras.startswith("act"), config=config, weight_scale=dev[5],
        )  # fmt: skip
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.cpu().double(), want, atol=2e-2, rtol=2e-2)


def test_gemv_rows_are_independent():
    """Three rows at once give each row's one-row result (fp32: the same products)."""
    gemv = _gemv_module()
    gen = torch.Generator().manual_seed(4)
    w, x = torch.randn(24, 40, generator=gen), torch.randn(3, 40, generator=gen)
    r = torch.randn(3, 24, generator=gen)
    cfg = gemv.GemvConfig(block_n=8, block_k=16, num_warps=2)
    dev = [t.to(DEVICE) for t in (x, w, r)]
    both = gemv.gemv(dev[0], dev[1], residual=dev[2], config=cfg)
    for i in range(3):
        one = gemv.gemv(dev[0][i : i + 1], dev[1], residual=dev[2][i : i + 1], config=cfg)
        torch.testing.assert_close(both[i : i + 1], one, atol=0, rtol=0)


def test_gemv_supported_rejects_what_it_cannot_run():
    from minisgl.kernels.gemv.gemv import gemv_supported

    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    assert gemv_supported(torch.zeros(1, 16, dtype=torch.bfloat16), w)
    assert gemv_supported(torch.zeros(1, 16, dtype=torch.bfloat16), w.to(torch.float8_e4m3fn))
    assert gemv_supported(torch.zeros(2, 16, dtype=torch.bfloat16), w, max_rows=4)
    assert not gemv_supported(torch.zeros(2, 16, dtype=torch.bfloat16), w)  # two rows
    assert not gemv_supported(torch.zeros(1, 16, dtype=torch.float16), w)  # dtype mismatch
    assert not gemv_supported(torch.zeros(1, 16, dtype=torch.int32), w.int())  # not a float


def test_gemv_reads_a_column_major_weight():
    """A weight whose memory is [K, N] (the CPU layers' layout) gives the same result."""
    gemv = _gemv_module()
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
    assert len(results) == len(COMPILE) + len(COMPILE_VEC)
    spilled = [r for r in results if r["local"] > 0]
    assert not spilled, f"register spills: {spilled}"
    # The FP8 vec variants' x, joined from two 16-byte loads, and their bytes of words are the
    # weights' layout under another name (register renames in the loop, no more): the only
    # shared memory is the final reductions' (a K step of x through it would be 8 KB).
    moved = [r for r in results if r["name"].startswith("vec") and r["shared"] > 256]
    assert not moved, f"layout conversions inside the K loop: {moved}"


# (name, constexprs, warps) compiled for sm_90 by the test above.
COMPILE = [
    ("bf16 plain 16x512 w4", dict(NORM=False, HAS_RES=False, BLOCK_N=16, BLOCK_K=512), 4),
    ("bf16 norm 16x256 w4", dict(NORM=True, HAS_RES=False, BLOCK_N=16, BLOCK_K=256), 4),
    ("bf16 residual 32x512 w8", dict(NORM=False, HAS_RES=True, BLOCK_N=32, BLOCK_K=512), 8),
    ("bf16 norm 4x256 w4", dict(NORM=True, HAS_RES=False, BLOCK_N=4, BLOCK_K=256), 4),
    ("bf16 norm 2x2048 w8", dict(NORM=True, HAS_RES=False, BLOCK_N=2, BLOCK_K=2048), 8),
    ("bf16 act residual 8x1024 w4", dict(NORM=False, ACT=True, HAS_RES=True, BLOCK_N=8, BLOCK_K=1024), 4),
    # FP8 (e4m3) weights: a scale per row, or per 128 x 128 block
    ("fp8 row norm 16x512 w4", dict(NORM=True, HAS_RES=False, BLOCK_N=16, BLOCK_K=512, W_SCALE=1), 4),
    ("fp8 block norm 16x512 w4", dict(NORM=True, HAS_RES=False, BLOCK_N=16, BLOCK_K=512, W_SCALE=2), 4),
    ("fp8 row act residual 8x1024 w4", dict(NORM=False, ACT=True, HAS_RES=True, BLOCK_N=8, BLOCK_K=1024, W_SCALE=1), 4),
    ("fp8 block act residual 8x512 w8", dict(NORM=False, ACT=True, HAS_RES=True, BLOCK_N=8, BLOCK_K=512, W_SCALE=2), 8),
]  # fmt: skip


# FP8 variants in the vec layout (`GemvConfig.layout` "vec"): the benchmark's quick sweep's
# kinds at one row of x, and two `TUNED_FP8` kinds at 2 and 4 rows ("rows": an FP8 layer's
# weight-only rows with `fp8_gemv_max_rows` above 1); per-row scales unless "block". Each
# thread's 16 columns are one 16-byte load of e4m3 (VEC 16, HALVES 2) or two 8-byte ones (VEC 8).
COMPILE_VEC = [
    ("vec words ptx keep norm 8x2048 w4", dict(NORM=True, BLOCK_N=8, WORDS=True, WIDEN=2, KEEP_VEC=True), 4),
    ("vec words ptx act residual 8x2048 w4", dict(ACT=True, HAS_RES=True, BLOCK_N=8, WORDS=True, WIDEN=2), 4),
    ("vec words ptx residual 16x2048 w4", dict(HAS_RES=True, BLOCK_N=16, WORDS=True, WIDEN=2), 4),
    ("vec words ptx keep norm 8x4096 w8", dict(NORM=True, BLOCK_N=8, BLOCK_K=4096, WORDS=True, WIDEN=2, KEEP_VEC=True), 8),
    ("vec words ptx keep norm block 8x2048 w4", dict(NORM=True, BLOCK_N=8, WORDS=True, WIDEN=2, KEEP_VEC=True, W_SCALE=2), 4),
    ("vec words cvt act residual 8x2048 w4", dict(ACT=True, HAS_RES=True, BLOCK_N=8, WORDS=True), 4),
    ("vec e4m3 cvt norm 8x2048 w4", dict(NORM=True, BLOCK_N=8), 4),
    ("vec e4m3 8 cvt norm 8x1024 w4", dict(NORM=True, BLOCK_N=8, BLOCK_K=1024, VEC=8), 4),
    ("vec rows 2 words ptx keep norm 8x2048 w4", dict(ROWS=2, NORM=True, BLOCK_N=8, WORDS=True, WIDEN=2, KEEP_VEC=True), 4),
    ("vec rows 4 words ptx act residual 8x2048 w4", dict(ROWS=4, ACT=True, HAS_RES=True, BLOCK_N=8, WORDS=True, WIDEN=2), 4),
]  # fmt: skip


def _compile_all() -> list[dict[str, object]]:
    from sm90 import compile_sm90

    from minisgl.kernels.gemv.gemv import _gemv_kernel, _gemv_rows_kernel

    out = []
    vec = [
        (n, {"ROWS": 1, "VEC": 16, "BLOCK_K": 2048, "W_SCALE": 1} | c, w) for n, c, w in COMPILE_VEC
    ]
    for kernel, variants in ((_gemv_kernel, COMPILE), (_gemv_rows_kernel, vec)):
        for name, c, warps in variants:
            types = {n: "*bf16" for n in ("x_ptr", "w_ptr", "y_ptr", "b_ptr", "r_ptr", "g_ptr")}
            types |= {"eps": "fp32", "s_ptr": "*fp32"}
            if c.get("W_SCALE"):
                types["w_ptr"] = "*fp8e4nv"
            c = {"ACT": False, "W_SCALE": 0, "HAS_RES": False, "NORM": False} | c
            c |= dict(HAS_BIAS=False, stride_wk=1)
            aligned = ["x_ptr", "w_ptr", "y_ptr", "stride_wn", "K"]
            if "ROWS" in c:  # a bf16 x whose rows start 16-byte aligned, as the models' do
                c = {"X_AHEAD": True, "VEC": 8, "KEEP_VEC": False, "WORDS": False} | c
                keep = c["KEEP_VEC"]
                c |= dict(XV=8, HALVES=c["VEC"] // 8, WIDEN=c.get("WIDEN", 0),
                          ACC_W=(c["VEC"] // 4 if c["WORDS"] else c["VEC"]) if keep else 1)  # fmt: skip
                # (as launched: pointers and multiples of 16 are specialised as such)
                aligned += ["stride_xm", "g_ptr", "r_ptr", "s_ptr"]
            out.append({"name": name, **compile_sm90(kernel, types, c, warps, None, aligned)})
    return out


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for result in _compile_all():
        print(json.dumps(result))
