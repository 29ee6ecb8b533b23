"""Fused elementwise kernels for the decoder layers: RMSNorm (with the residual add), q/k
RMSNorm with rotary embedding (and the KV store), SiLU-and-multiply. One launch each instead of
the 5-10 small torch kernels the reference layers issue; in a decode step at small batch those
launches, not bytes, set the time. Numerics follow the torch layers (`minisgl.layers`): fp32
math, roundings to the model dtype at the same points (the residual sum, the normalised value
before the weight, the SiLU output before the multiply). The layers reach every kernel through
this module (`minisgl.layers.fused`), the GEMVs and the MoE layer too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.attention.common import quantize_fp8, store_args, v_row_ptrs
from minisgl.kernels.common import is_interpreted, pdl_args, pdl_prologue
from minisgl.kernels.fp8.gemm import fp8_linear as fp8_linear
from minisgl.kernels.gemv.gemv import gemv as gemv
from minisgl.kernels.gemv.skinny import skinny as skinny
from minisgl.kernels.moe.layer import one_row_moe as one_row_moe


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows, heads, stride of a token, stride of a head) of a [T, D] or [T, H, D] view."""
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    assert x.dim() == 3
    return x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, H, D] view (H = 1 for [T, D]), last dim contiguous
    res_ptr,  # [T, D] contiguous residual (HAS_RESIDUAL)
    w_ptr,  # [D]
    out_ptr,  # [T * H, D] contiguous
    res_out_ptr,  # [T, D] contiguous, x + residual (HAS_RESIDUAL)
    stride_t, stride_h, num_heads, dim, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    t = row // num_heads
    h = row % num_heads
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    x = tl.load(x_ptr + t * stride_t + h * stride_h + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * dim + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * dim + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / dim + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = (xf * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * dim + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [T, D] or [T, H, D], last dim contiguous
    weight: torch.Tensor,  # [D]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, D] contiguous
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual); without a residual the second is `x`."""
    dim = x.shape[-1]
    assert x.stride(-1) == 1 and weight.shape == (dim,)
    rows, heads, stride_t, stride_h = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = x
    if residual is not None:
        assert x.dim() == 2 and residual.shape == x.shape and residual.is_contiguous()
        res_out = torch.empty_like(residual)
    if rows == 0:
        return out, res_out
    block = triton.next_power_of_2(dim)
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, res_out, stride_t, stride_h,
        heads, dim, eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=max(1, min(8, block // 256)), **pdl_args(x.device),
    )  # fmt: skip
    return out, res_out


@triton.jit
def _norm_rope_heads(
    x_ptr,  # this token's first head, [H, D] with head stride `stride_h`
    out_ptr,  # where this token's first head goes, head stride `stride_out_h`
    w_ptr,  # [D] RMSNorm weight (HAS_NORM)
    stride_h, stride_out_h, num_heads,
    cos,  # [1, HALF] fp32
    sin, eps,
    scale_ptr,  # [H] fp32: each head's result is divided by its scale (QUANT)
    shift_ptr,  # [H, 2 * HALF] fp32: and first has this subtracted (QUANT)
    HAS_NORM: tl.constexpr, QUANT: tl.constexpr, EMULATE_FP8: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):  # fmt: skip
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < num_heads)[:, None]
    src = x_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    if HAS_NORM:  # per-head RMSNorm, rounded to the model dtype like the torch layer's output
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        rstd = 1.0 / tl.sqrt((tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + offs_d).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_d).to(tl.float32)[None, :]
        x1 = (w1 * (f1 * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype)
        x2 = (w2 * (f2 * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype)
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(dtype)  # rounded to the model dtype, as the torch layer's
    y2 = (x2 * cos + x1 * sin).to(dtype)
    if QUANT:  # into an FP8 cache: divided by the head's scale (`kernels.fp8.quantize_kv`)
        scale = tl.load(scale_ptr + offs_h, mask=offs_h < num_heads, other=1.0)
        shift = shift_ptr + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
        y1 = quantize_fp8(y1, scale, tl.load(shift, mask=mask, other=0.0), EMULATE_FP8)
        y2 = quantize_fp8(y2, scale, tl.load(shift + HALF, mask=mask, other=0.0), EMULATE_FP8)
    out_ty = out_ptr.dtype.element_ty
    dst = out_ptr + offs_h[:, None] * stride_out_h + offs_d[None, :]
    tl.store(dst, y1.to(out_ty), mask=mask)
    tl.store(dst + HALF, y2.to(out_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,  # [T, Hq, D] view, last dim contiguous
    k_ptr,  # [T, Hkv, D] view
    v_ptr,  # [T, Hkv, D] view (STORE)
    q_out_ptr,  # [T, Hq, D] contiguous
    k_out_ptr,  # [T, Hkv, D] contiguous (not STORE)
    k_cache_ptr,  # [slots, Hkv, D] (STORE): the rotated k goes here, at slot loc[t]
    v_cache_ptr,  # [slots, Hkv, D] (STORE): v goes here; FP8: [pages, Hkv, D, PAGE_SIZE]
    loc_ptr,  # [T] int64 KV slot of each token (STORE)
    k_scale_ptr,  # [Hkv] fp32 (KV_FP8)
    v_scale_ptr,  # [Hkv] fp32 (KV_FP8)
    k_shift_ptr,  # [Hkv, D] fp32 (KV_FP8)
    q_w_ptr,  # [D] (HAS_NORM)
    k_w_ptr,  # [D] (HAS_NORM)
    pos_ptr,  # [T] int64 (any stride)
    cos_sin_ptr,  # [max_pos, D] fp32: cos in the first half, sin in the second
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ckt, stride_ckh,
    stride_cvt, stride_cvh, stride_pos, num_q_heads, num_kv_heads, eps, HAS_NORM: tl.constexpr,
    STORE: tl.constexpr, KV_FP8: tl.constexpr, EMULATE_FP8: tl.constexpr,
    PAGE_SIZE: tl.constexpr,  # of an FP8 V cache, whose pages are [Hkv, D, PAGE_SIZE]
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t * stride_pos)
    offs_d = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + offs_d)[None, :]
    sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + offs_d)[None, :]
    if tl.program_id(1) == 0:
        _norm_rope_heads(
            q_ptr + t * stride_qt, q_out_ptr + t * num_q_heads * (2 * HALF), q_w_ptr, stride_qh,
            2 * HALF, num_q_heads, cos, sin, eps, k_scale_ptr, k_shift_ptr, HAS_NORM, False, False,
            HALF, BLOCK_H,
        )  # fmt: skip
    elif STORE:  # the rotated k and the new v straight into the paged KV pool
        slot = tl.load(loc_ptr + t)
        _norm_rope_heads(
            k_ptr + t * stride_kt, k_cache_ptr + slot * stride_ckt, k_w_ptr, stride_kh,
            stride_ckh, num_kv_heads, cos, sin, eps, k_scale_ptr, k_shift_ptr, HAS_NORM, KV_FP8,
            EMULATE_FP8, HALF, BLOCK_H,
        )  # fmt: skip
        offs_h = tl.arange(0, BLOCK_H)
        mask_h = offs_h < num_kv_heads
        offs_v = tl.arange(0, 2 * HALF)
        v = tl.load(
            v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_v[None, :],
            mask=mask_h[:, None],
        )
        if KV_FP8:
            v_scale = tl.load(v_scale_ptr + offs_h, mask=mask_h, other=1.0)
            v = quantize_fp8(v, v_scale, 0.0, EMULATE_FP8)
        v_dst = v_row_ptrs(
            v_cache_ptr, slot, offs_h, offs_v, stride_cvt, stride_cvh, PAGE_SIZE, KV_FP8
        )
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask_h[:, None])
    else:
        _norm_rope_heads(
            k_ptr + t * stride_kt, k_out_ptr + t * num_kv_heads * (2 * HALF), k_w_ptr, stride_kh,
            2 * HALF, num_kv_heads, cos, sin, eps, k_scale_ptr, k_shift_ptr, HAS_NORM, False, False,
            HALF, BLOCK_H,
        )  # fmt: skip


def rotary_supported(head_dim: int) -> bool:
    return head_dim >= 4 and head_dim & (head_dim - 1) == 0


def qk_norm_rope(
    positions: torch.Tensor,  # [T] int64, any stride
    q: torch.Tensor,  # [T, Hq, D], last dim contiguous
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin: torch.Tensor,  # [max_pos, D] fp32 contiguous
    q_weight: torch.Tensor | None = None,  # [D] per-head RMSNorm weights (Qwen3), or None
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    v: torch.Tensor | None = None,  # [T, Hkv, D], with `store`
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # k_cache, v_cache, loc
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # FP8 cache: [Hkv] fp32 each
    k_shift: torch.Tensor | None = None,  # FP8 cache: [Hkv, D] fp32 subtracted from k (else 0)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Optional per-head RMSNorm of q and k, then rotate-half (neox) rotary embedding, in one
    launch; new contiguous tensors. With `store` = (k_cache [slots, Hkv, D], v_cache, loc [T]
    int64) and `v`, the rotated k and v go into the KV pool at slots `loc` instead (the KV store
    and the rotation in one kernel) and k comes back None; into an FP8 pool minus `k_shift`
    and divided by its per-head `kv_scales` (the rotated k rounded to the model dtype first, as
    unfused)."""
    tokens, q_heads, dim = q.shape
    kv_heads = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin.is_contiguous()
    assert cos_sin.dtype == torch.float32 and cos_sin.shape[1] == dim == k.shape[2]
    has_norm = q_weight is not None
    assert has_norm == (k_weight is not None)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if store is not None:
        kc, vc, loc = store
        assert v is not None and v.shape == k.shape and v.stride(-1) == 1
        assert loc.shape == (tokens,) and kc.shape[1:] == k.shape[1:]
        assert kc.stride(-1) == 1 and vc.stride(-1) == 1
        page_size, fp8, k_scale, v_scale, shift = store_args(kc, vc, kv_scales, k_shift, cos_sin)
        k_out, vv = None, v
    else:
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        kc = vc = vv = k_out
        loc = positions
        page_size, fp8, k_scale, v_scale, shift = 1, False, cos_sin, cos_sin, cos_sin
    if tokens == 0:
        return q_out, k_out
    _qk_norm_rope_kernel[(tokens, 2)](
        q, k, vv, q_out, k_out if k_out is not None else q_out, kc, vc, loc, k_scale, v_scale,
        shift,
        q_weight if has_norm else q, k_weight if has_norm else k, positions, cos_sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), vv.stride(0), vv.stride(1),
        kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), positions.stride(0), q_heads,
        kv_heads, eps, HAS_NORM=has_norm, STORE=store is not None, KV_FP8=fp8,
        EMULATE_FP8=fp8 and is_interpreted(_qk_norm_rope_kernel), PAGE_SIZE=page_size, HALF=dim // 2,
        BLOCK_H=triton.next_power_of_2(max(q_heads, kv_heads)), num_warps=4,
        **pdl_args(q.device),
    )  # fmt: skip
    return q_out, k_out


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, n, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + t * stride_x + n + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu, rounded like its output
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2n] -> [T, n]: silu(gate) * up."""
    assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] % 2 == 0
    tokens, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(tokens, n, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(tokens, triton.cdiv(n, block))](
        x, out, x.stride(0), out.stride(0), n, BLOCK=block, num_warps=4, **pdl_args(x.device)
    )
    return out
