"""The W8A8 blocked MoE path (`minisgl.kernels.moe.w8a8`): e4m3 activations x e4m3 experts.

What is tested how:
- the kernels' numerics, in Triton's CPU interpreter without CUDA (the same kernels: its
  e4m3 x e4m3 tl.dot is exact in fp32; its fp32 -> e4m3 casts round wrongly, so the
  quantizing stores go through `round_e4m3` there, EMULATE_FP8), against (a) a torch model of
  the same roundings, tightly, and (b)
  `moe_reference` on the dequantized experts within an element-wise bound derived from e4m3's
  precision (`w8a8_bound`);
- the wiring: `fused_experts` takes the path when `MINISGL_MOE_W8A8` is on (the default;
  and only then), read at the call;
- the FP8 tensor-core lowering, which the interpreter never sees: compiled for sm_90 in a
  subprocess (`test_w8a8_kernels_compile_for_sm90`): FP8 wgmma (SASS `QGMMA ... E4M3.E4M3`)
  in the main loop, no conversions of the weights there, no register spills.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest
import torch

COMPILE_MODE = __name__ == "__main__"  # the subprocess of the compile test
if not torch.cuda.is_available() and not COMPILE_MODE:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed (optional dependency 'gpu')")

from minisgl.config import env  # noqa: E402
from minisgl.kernels.common import is_interpreted  # noqa: E402
from minisgl.kernels.fp8 import (  # noqa: E402
    FP8_REL_ERR,
    ExpertScales,  # noqa: E402
    round_trip_activations,
)
from minisgl.kernels.moe import w8a8 as F  # noqa: E402
from minisgl.kernels.moe.layer import fused_experts  # noqa: E402
from minisgl.kernels.moe.routing import moe_align  # noqa: E402
from minisgl.kernels.moe.tiles import DEFAULT_CONFIGS, FusedMoEConfig, GemmTile  # noqa: E402
from minisgl.layers.moe import Routing, moe_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not COMPILE_MODE and not is_interpreted(F._w8a8_gate_up_kernel):
    pytest.skip("minisgl.kernels was imported before TRITON_INTERPRET=1", allow_module_level=True)

# Gate/up at 128 columns (quantizes its output in the epilogue) or 64 (a separate launch does);
# BLOCK_K 64 takes two K steps per activation group.
FUSED = F.W8A8Config(GemmTile(128, 128, 4, 4), GemmTile(64, 128, 4, 4))
SPLIT = F.W8A8Config(GemmTile(64, 64, 4, 4), GemmTile(128, 64, 4, 4))
CONFIGS = pytest.mark.parametrize("config", [FUSED, SPLIT], ids=["fused-quant", "split-quant"])


def experts(num_experts: int, hidden: int, inter: int, layout: str, seed: int) -> Any:
    """e4m3 stacks with their scales (per row or per 128 x 128 block), and their fp32 values."""
    from helpers import quantize_expert_stack

    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in ((num_experts, 2 * inter, hidden), (num_experts, hidden, inter)):
        w = torch.randn(*shape, generator=g) / shape[2] ** 0.5
        q, s, deq = quantize_expert_stack(w, layout)
        out.append((q.to(DEVICE), s.to(DEVICE), deq.double()))
    (q13, s13, d13), (q2, s2, d2) = out
    return q13, q2, ExpertScales(s13, s2), d13, d2


def routing(num_tokens: int, num_experts: int, top_k: int, seed: int) -> Routing:
    """Distinct experts per token, skewed towards low ids (uneven runs, some experts idle)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=g) ** 4 * torch.arange(
        num_experts, 0, -1
    )
    ids = scores.topk(top_k, dim=-1).indices
    return Routing(torch.rand(num_tokens, top_k, generator=g), ids)


def group_scales(v: torch.Tensor) -> torch.Tensor:
    """Each element's e4m3 scale: its row's max |v| over its 128-column group / 448."""
    cols = v.shape[1]
    padded = torch.nn.functional.pad(v.abs(), (0, -cols % 128))
    return padded.unflatten(1, (-1, 128)).amax(-1).repeat_interleave(128, 1)[:, :cols] / 448


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


def w8a8_model(
    x: torch.Tensor, d13: torch.Tensor, d2: torch.Tensor, r: Routing, split: bool
) -> torch.Tensor:
    """The path's math in fp64 on the same roundings: x and each pair's silu(gate) * up
    rounded to e4m3 per token and 128 columns (`round_trip_activations`; `split`: the latter
    stored in bf16 first, as the separate quantization launch reads it), the dequantized
    experts, exact sums."""
    inter = d2.shape[2]
    xq = round_trip_activations(x.float(), 128).double()  # [T, H]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for k in range(r.ids.shape[1]):
        w13, w2 = d13[r.ids[:, k]], d2[r.ids[:, k]]  # [T, 2I, H], [T, H, I]
        gu = torch.einsum("th,tnh->tn", xq, w13)
        h = silu(gu[:, :inter]) * gu[:, inter:]
        h = h.to(torch.bfloat16) if split else h.float()
        hq = round_trip_activations(h, 128).double()
        out += r.weights[:, k, None].double() * torch.einsum("ti,thi->th", hq, w2)
    return out


def w8a8_bound(x: torch.Tensor, d13: torch.Tensor, d2: torch.Tensor, r: Routing) -> torch.Tensor:
    """A bound on |W8A8 output - moe_reference| per element (first order, fp64).

    e4m3 keeps 3 mantissa bits: a value v in the normal range rounds with relative error at
    most u = 2^-4 (FP8_REL_ERR); below it (|v| < 2^-6 of the scale's 448) the grid step is 2^-9
    of the scale. A rounding error is spread evenly over +-half a step, so its variance is at
    most (u v)^2 / 3 (+ (2^-10 s)^2 / 3 below the normal range). The path rounds x, then each
    pair's silu(gate) * up; every output sums hundreds of such independent errors, so the
    worst case (all of them at +u, in step with the weights' signs: some 25 x the output's
    size at these shapes) is far from what happens, and the bound is 6 standard deviations of
    the summed error, propagated through the GEMMs (variances times w^2) and the SwiGLU (its
    derivatives), plus the deterministic parts: the bf16 stores of each (token, k) row and of
    the sum over k (2^-9 each), and the accumulation: on Hopper 2^-11 of the sums of |products|
    (the FP8 wgmma keeps ~14 bits within a 128-column step, promoted to fp32 after it), in the
    interpreter 2^-16 (fp32 throughout)."""
    inter = d2.shape[2]
    u2, acc = FP8_REL_ERR**2 / 3, 2.0**-11 if DEVICE == "cuda" else 2.0**-16
    xd = x.double()
    var_x = u2 * xd**2 + (2.0**-10 * group_scales(xd)) ** 2 / 3
    var_out = torch.zeros(x.shape, dtype=torch.float64)
    det = torch.zeros(x.shape, dtype=torch.float64)
    for k in range(r.ids.shape[1]):
        w13, w2 = d13[r.ids[:, k]], d2[r.ids[:, k]]  # [T, 2I, H], [T, H, I]
        gu = torch.einsum("th,tnh->tn", xd, w13)
        var_gu = torch.einsum("th,tnh->tn", var_x, w13**2)
        mag = torch.einsum("th,tnh->tn", xd.abs(), w13.abs())
        g, up = gu[:, :inter], gu[:, inter:]
        sg = torch.sigmoid(g)
        dsilu = sg * (1 + g * (1 - sg))
        h = silu(g) * up
        var_h = (dsilu * up) ** 2 * var_gu[:, :inter] + silu(g) ** 2 * var_gu[:, inter:]
        var_h = var_h + u2 * h**2 + (2.0**-10 * group_scales(h)) ** 2 / 3
        det_h = acc * (dsilu.abs() * up.abs() * mag[:, :inter] + silu(g).abs() * mag[:, inter:])
        rk = r.weights[:, k, None].double()
        row_abs = torch.einsum("ti,thi->th", h.abs(), w2.abs())
        var_out += rk**2 * torch.einsum("ti,thi->th", var_h, w2**2)
        det += rk * (torch.einsum("ti,thi->th", det_h, w2.abs()) + acc * row_abs)
        det += rk * 2.0**-9 * torch.einsum("ti,thi->th", h, w2).abs()
    ref = moe_reference(xd, d13, d2, r)
    return 6 * var_out.sqrt() + det + 2.0**-9 * ref.abs()


@CONFIGS
@pytest.mark.parametrize("layout", ["row", "block"])
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "block_m"),
    [(1, 16, 8, 16), (16, 16, 2, 16), (16, 128, 8, 16), (64, 16, 4, 16), (64, 32, 8, 32)],
)
def test_w8a8_experts_match_reference(
    config: F.W8A8Config, layout: str, num_tokens: int, num_experts: int, top_k: int, block_m: int
) -> None:
    # I = 192: the last 128-column group of the activations is ragged (masked in every kernel)
    hidden, inter = 256, 192 if layout == "row" else 256
    q13, q2, scales, d13, d2 = experts(num_experts, hidden, inter, layout, seed=num_tokens)
    g = torch.Generator().manual_seed(num_tokens + top_k)
    x = (torch.randn(num_tokens, hidden, generator=g) * 2).to(torch.bfloat16)
    r = routing(num_tokens, num_experts, top_k, seed=top_k)
    rows = moe_align(r.ids.to(DEVICE, torch.int32), num_experts, block_m)
    pairs = F.w8a8_experts(x.to(DEVICE), q13, q2, scales, r.weights.to(DEVICE), rows, config)
    out = pairs.view(num_tokens, top_k, hidden).sum(dim=1).cpu().double()
    assert pairs.dtype == torch.bfloat16

    # (a) the same roundings in torch: only the bf16 stores and the summation order differ
    # (which may move an activation across an e4m3 rounding boundary now and then, a step of
    # 2^-3 of that value). The split variant's bf16 activations are rounded twice (bf16, then
    # e4m3), and the interpreter's fp32 -> bf16 cast truncates (`test_moe_kernel.TOL`), which
    # biases those boundary crossings towards zero: twice the tolerance there.
    split = config.gate_up.block_n != 128
    model = w8a8_model(x, d13, d2, r, split)
    tol = 4e-2 if split and DEVICE == "cpu" else 2e-2
    assert (out - model).abs().max() <= tol * model.abs().max()
    # (b) the unquantized activations: within the bound derived from e4m3's precision
    ref = moe_reference(x.double(), d13, d2, r)
    err = (out - ref).abs()
    bound = w8a8_bound(x, d13, d2, r)
    assert (err <= bound).all(), (err / bound).max()
    # the bound is not vacuous: at most a fifth of the output's scale in the interpreter (the
    # errors measured there reach about half the bound, the bound 13-19% of max |output|), 0.3
    # on CUDA, where the accumulation term is 2^-11 of the sums of |products| (the H200: the
    # bound 21-26% of max |output|, and (a) above within 2%)
    assert bound.max() <= (0.3 if DEVICE == "cuda" else 0.2) * ref.abs().max()


@pytest.mark.parametrize(("enabled", "min_block_m"), [(True, 16), (True, 32), (False, 16)])
def test_fused_experts_takes_the_w8a8_path_when_enabled(
    monkeypatch: pytest.MonkeyPatch, enabled: bool, min_block_m: int
) -> None:
    num_tokens, num_experts, top_k, hidden, inter = 16, 16, 4, 256, 128
    q13, q2, scales, d13, d2 = experts(num_experts, hidden, inter, "row", seed=5)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(7))
    x = x.to(torch.bfloat16)
    r = routing(num_tokens, num_experts, top_k, seed=6)
    monkeypatch.setenv(env.MOE_W8A8.name, str(int(enabled)))
    monkeypatch.setenv(env.MOE_W8A8_BLOCK_M.name, str(min_block_m))
    calls: list[int] = []
    real = F.w8a8_experts

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(args[5].block_m)  # the AlignedRows: the W8A8 path's own BLOCK_M
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "w8a8_experts", spy)
    cfg = FusedMoEConfig(16, GemmTile(32, 128), GemmTile(32, 128))
    out = fused_experts(
        x.to(DEVICE), q13, q2, r.weights.to(DEVICE), r.ids.to(DEVICE, torch.int32), cfg, scales
    )
    assert calls == ([min_block_m] if enabled else [])
    ref = moe_reference(x.double(), d13, d2, r)
    assert (out.cpu().double() - ref).abs().max() <= 0.1 * ref.abs().max()


def test_w8a8_is_the_default_for_fp8_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    """On unless `MINISGL_MOE_W8A8=0` (measured 1.46x bf16 experts at decode batch 256 on the
    H200, against 1.05x for the weight-only path), with a least BLOCK_M of 16."""
    monkeypatch.delenv(env.MOE_W8A8.name, raising=False)
    monkeypatch.delenv(env.MOE_W8A8_BLOCK_M.name, raising=False)
    x = torch.zeros(4, 128, dtype=torch.bfloat16, device=DEVICE)
    assert F.use_w8a8(x, torch.zeros(2, 256, 128, device=DEVICE).to(torch.float8_e4m3fn), 16)
    assert [F.w8a8_block_m(m) for m in (8, 16, 32)] == [16, 16, 32]


def test_w8a8_is_not_taken_for_16_bit_experts_or_tall_blocks(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(env.MOE_W8A8.name, "1")
    x = torch.zeros(4, 128, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(2, 256, 128, device=DEVICE)
    assert F.use_w8a8(x, w.to(torch.float8_e4m3fn), 16)
    assert not F.use_w8a8(x, w.to(torch.bfloat16), 16)
    assert not F.use_w8a8(x, w.to(torch.float8_e4m3fn), 2 * F.MAX_BLOCK_M)
    monkeypatch.setenv(env.MOE_W8A8.name, "0")  # read at the call: no restart, no reload
    assert not F.use_w8a8(x, w.to(torch.float8_e4m3fn), 16)
    monkeypatch.setenv(env.MOE_W8A8_BLOCK_M.name, "32")
    assert [F.w8a8_block_m(m) for m in (16, 32, 64)] == [32, 32, 64]


def test_w8a8_tables_cover_the_blocked_decode_sizes() -> None:
    sizes = {c.block_m for c in DEFAULT_CONFIGS.values() if isinstance(c, FusedMoEConfig)}
    for m in sizes:
        if m <= F.MAX_BLOCK_M:
            cfg = F.w8a8_config(m)
            assert cfg.gate_up.block_n % 64 == 0 and cfg.down.block_n % 64 == 0
            assert 128 % cfg.gate_up.block_k == 0 and 128 % cfg.down.block_k == 0


# ---- compile for sm_90 without a GPU -----------------------------------------------------------

_TYPES = {
    "xq_ptr": "*fp8e4nv", "aq_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "xs_ptr": "*fp32",
    "as_ptr": "*fp32", "s_ptr": "*fp32", "acts_ptr": "*fp32", "sorted_ids_ptr": "*i32",
    "block_expert_ptr": "*i32", "num_padded_ptr": "*i32", "topk_weights_ptr": "*fp32",
    "out_ptr": "*bf16",
}  # fmt: skip


def _variants() -> list[tuple[str, Any, dict[str, Any], GemmTile]]:
    """Every table entry's two kernels, per-row and block weight scales (and the split-quant
    gate/up variant at BLOCK_M 16)."""
    out = []
    tiles = [(m, c.gate_up, c.down) for m, c in F.W8A8_CONFIGS.items()]
    tiles.append((16, SPLIT.gate_up, SPLIT.down))
    for block_m, gu, dn in tiles:
        for w_scale in (1, 2):
            c = dict(TOP_K=8, BLOCK_M=block_m, BLOCK_N=gu.block_n, BLOCK_K=gu.block_k,
                     W_SCALE=w_scale, QUANT_OUT=gu.block_n == 128,
                     EMULATE_FP8=False)  # fmt: skip
            out.append(
                (f"gate_up m{block_m} {gu} w_scale={w_scale}", F._w8a8_gate_up_kernel, c, gu)
            )
            c = dict(BLOCK_M=block_m, BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, W_SCALE=w_scale)
            out.append((f"down m{block_m} {dn} w_scale={w_scale}", F._w8a8_down_kernel, c, dn))
    return out


def _compile_all() -> list[dict[str, Any]]:
    from sm90 import compile_sm90

    results = []
    for name, kernel, c, tile in _variants():
        types = dict(_TYPES)
        if kernel is F._w8a8_gate_up_kernel:
            types["act_ptr"] = "*fp8e4nv" if c["QUANT_OUT"] else "*bf16"
        # as launched at the Qwen3-30B-A3B shape: pointers, sizes and strides multiples of 16
        aligned = [n for n in kernel.arg_names if n not in c and n not in ("numel", "PDL")]
        result = compile_sm90(kernel, types, c, tile.num_warps, tile.num_stages, aligned, sass=True)
        results.append({"name": name, **result})
    return results


@pytest.mark.slow
def test_w8a8_kernels_compile_for_sm90() -> None:
    from sm90 import run_compile_script

    results = run_compile_script(__file__)
    assert len(results) == len(_variants())
    assert not [r for r in results if r["local"] > 0], f"register spills: {results}"
    assert all(r["shared"] <= 227 * 1024 for r in results), results
    for r in results:
        loop = max(r["loops"], key=lambda lp: lp["total"])  # the K loop
        ops: dict[str, int] = {}
        for op, n in loop.items():  # opcodes without their modifiers
            if op != "total":
                ops[op.split(".")[0]] = ops.get(op.split(".")[0], 0) + n
        # e4m3 x e4m3 wgmma in the loop (QGMMA; HGMMA is its 16-bit form)...
        assert ops.get("QGMMA", 0) > 0, r
        # ...and no per-element conversions there: e4m3 -> 16-bit widening is F2FP / HADD2.F32
        # / I2F / PRMT work; the loop holds only loads, wgmma and the fp32 scale products.
        conversions = {op: n for op, n in ops.items() if op in ("F2FP", "F2F", "I2F", "PRMT")}
        assert not conversions, (r["name"], conversions)


if COMPILE_MODE:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for result in _compile_all():
        print(json.dumps(result))
