"""Fused elementwise kernels for the decoder layers: RMSNorm (with the residual add), rotary
embedding, SiLU-and-multiply. One launch each instead of the 5-10 small torch kernels the
reference layers issue; in a decode step at small batch those launches, not bytes, set the
time. Numerics follow the torch layers (`minisgl.layers`): fp32 math, roundings to the model
dtype at the same points (the residual sum, the normalised value before the weight, the SiLU
output before the multiply).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    stride_t,
    stride_h,
    num_heads,
    dim,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
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
        num_warps=max(1, min(8, block // 256)),
    )  # fmt: skip
    return out, res_out


@triton.jit
def _rotary_kernel(
    x_ptr,  # [T, H, D] view, last dim contiguous
    out_ptr,  # [T, H, D] contiguous
    pos_ptr,  # [T] int64 (any stride)
    cos_sin_ptr,  # [max_pos, D] fp32: cos in the first half, sin in the second
    stride_t,
    stride_h,
    stride_pos,
    num_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t * stride_pos)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < num_heads)[:, None]
    cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + offs_d)[None, :]
    sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + offs_d)[None, :]
    src = x_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + (t * num_heads + offs_h[:, None]) * (2 * HALF) + offs_d[None, :]
    dtype = out_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


def _rotate(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    tokens, heads, dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    _rotary_kernel[(tokens,)](
        x, out, positions, cos_sin, x.stride(0), x.stride(1), positions.stride(0), heads,
        HALF=dim // 2, BLOCK_H=triton.next_power_of_2(heads), num_warps=4,
    )  # fmt: skip
    return out


def rotary_supported(head_dim: int) -> bool:
    return head_dim >= 4 and head_dim & (head_dim - 1) == 0


def rotary(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D], last dim contiguous
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin: torch.Tensor,  # [max_pos, D] fp32 contiguous
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half (neox) rotary embedding of q and k; new contiguous tensors."""
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin.is_contiguous()
    assert cos_sin.dtype == torch.float32 and cos_sin.shape[1] == q.shape[2]
    return _rotate(q, positions, cos_sin), _rotate(k, positions, cos_sin)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n, BLOCK: tl.constexpr):
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
        x, out, x.stride(0), out.stride(0), n, BLOCK=block, num_warps=4
    )
    return out
