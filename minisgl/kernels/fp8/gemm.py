"""FP8 (e4m3) GEMMs for linear layers at larger batches, with activations quantized per token at
run time (imports Triton).

- `quantize_activations`: one scale per token (`group=None`), or per token and 128 columns for
  block-scaled weights; x / scale rounded to e4m3, as `minisgl.kernels.fp8.quantize_activations`.
- `fp8_linear`: y = (x_q * x_scale) @ (w_q * w_scale)^T + bias on FP8 tensor cores. Weights with
  one scale per output channel go to torch's row-wise scaled GEMM (`torch._scaled_mm`; Hopper)
  when the output is bf16 and the shapes suit it; 128 x 128 block scales (and the rest, and Ada)
  to the Triton kernel below, which multiplies each 128-deep partial product by its two scales.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minisgl.kernels.common import is_interpreted, pdl_args, pdl_prologue, round_e4m3

BLOCK = 128  # of the block-scaled weights and the activation groups that go with them


# ---- activations ------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["K"])
def _act_quant_kernel(
    x_ptr,  # [M, K]
    q_ptr,  # [M, K] e4m3 contiguous
    s_ptr,  # [M, cdiv(K, GROUP)] fp32 contiguous
    K, stride_xm,
    GROUP: tl.constexpr,  # columns per scale (a multiple of BLOCK, or >= K for one per token)
    BLOCK: tl.constexpr, EMULATE_FP8: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    start = group * GROUP
    end = tl.minimum(start + GROUP, K)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], tl.float32)
    for k in range(start, end, BLOCK):
        x = tl.load(x_ptr + row * stride_xm + k + offs, mask=k + offs < end, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    # IEEE divisions (Triton's `/` may be approximate): the torch reference's e4m3 values
    scale = tl.math.div_rn(tl.maximum(amax, 1e-12), tl.full([BLOCK], 448.0, tl.float32))
    scale = tl.max(scale, 0)  # max of equal-or-smaller quotients: the row's largest / 448
    tl.store(s_ptr + row * tl.num_programs(1) + group, scale)
    for k in range(start, end, BLOCK):
        x = tl.load(x_ptr + row * stride_xm + k + offs, mask=k + offs < end, other=0.0)
        y = tl.math.div_rn(x.to(tl.float32), tl.full([BLOCK], 0.0, tl.float32) + scale)
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        if EMULATE_FP8:  # the interpreter's e4m3 cast rounds wrongly (see `quantize_fp8`)
            y = round_e4m3(y)
        tl.store(q_ptr + row * K + k + offs, y.to(q_ptr.dtype.element_ty), mask=k + offs < end)


def quantize_activations(
    x: torch.Tensor,  # [M, K], last dim contiguous
    group: int | None = None,  # None: one scale per token; else per `group` columns
) -> tuple[torch.Tensor, torch.Tensor]:  # e4m3 [M, K], fp32 [M, groups]
    m, k = x.shape
    assert x.stride(1) == 1
    cols = k if group is None else group
    groups = triton.cdiv(k, cols)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    block = min(triton.next_power_of_2(cols), 1024)
    _act_quant_kernel[(m, groups)](
        x, q, s, k, x.stride(0), GROUP=cols if group is not None else triton.next_power_of_2(k),
        BLOCK=block, EMULATE_FP8=is_interpreted(_act_quant_kernel), num_warps=4 if block >= 512 else 1,
        **pdl_args(x.device),
    )  # fmt: skip
    return q, s


# ---- the GEMM ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int
    block_n: int = 128
    block_k: int = 128  # must be 128 with block-scaled weights (one scale pair per K step)
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4


def default_gemm_config(m: int) -> Fp8GemmConfig:
    """Starting points for an H100/H200 (to be swept on the GPU): a tile as tall as the batch,
    up to 128 rows."""
    block_m = min(128, max(16, triton.next_power_of_2(m)))
    if block_m == 128:
        return Fp8GemmConfig(block_m, num_warps=8, num_stages=3)
    return Fp8GemmConfig(block_m)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    a_ptr,  # [M, K] e4m3 contiguous
    as_ptr,  # [M, cdiv(K, 128)] fp32 (W_BLOCK) or [M, 1] fp32
    b_ptr,  # [N, K] e4m3, K contiguous
    bs_ptr,  # [cdiv(N, 128), cdiv(K, 128)] fp32 (W_BLOCK) or [N] fp32
    c_ptr,  # [M, N] contiguous
    bias_ptr,  # [N] (HAS_BIAS)
    M, N, K, stride_asm, stride_bn, stride_bsn, W_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    # Tiles in groups of GROUP_M rows of tiles: neighbouring programs share B tiles in L2.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        mask_k = offs_k < K - kt * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:  # the CPU interpreter: products of the exact e4m3 values in fp32
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        # Each K step's dot starts from zero and is added to `acc` in full fp32: Hopper's FP8
        # MMAs accumulate in reduced precision, so the error is bounded per 128 columns rather
        # than growing over all of K (the promotion DeepSeek-V3 describes).
        if W_BLOCK:
            sa = tl.load(as_ptr + offs_m * stride_asm + kt, mask=mask_m, other=0.0)
            sb = tl.load(bs_ptr + (offs_n // 128) * stride_bsn + kt, mask=mask_n, other=0.0)
            acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if not W_BLOCK:
        sa = tl.load(as_ptr + offs_m * stride_asm, mask=mask_m, other=0.0)
        sb = tl.load(bs_ptr + offs_n, mask=mask_n, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def fp8_gemm(
    a: torch.Tensor,  # [M, K] e4m3
    a_scale: torch.Tensor,  # [M, cdiv(K, 128)] with block-scaled b, else [M, 1]
    b: torch.Tensor,  # [N, K] e4m3
    b_scale: torch.Tensor,  # [cdiv(N, 128), cdiv(K, 128)] or [N]
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,  # [N]
    config: Fp8GemmConfig | None = None,
) -> torch.Tensor:  # [M, N]
    """The Triton FP8 GEMM (either weight-scale layout)."""
    m, k = a.shape
    n = b.shape[0]
    w_block = b_scale.dim() == 2
    assert a.is_contiguous() and b.stride(1) == 1 and b.shape[1] == k
    assert a_scale.shape == (m, triton.cdiv(k, BLOCK) if w_block else 1)
    cfg = config or default_gemm_config(m)
    assert not w_block or cfg.block_k == BLOCK
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _fp8_gemm_kernel[grid](
        a, a_scale, b, b_scale, c, bias if bias is not None else c, m, n, k, a_scale.stride(0),
        b.stride(0), b_scale.stride(0), W_BLOCK=w_block, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        UPCAST=is_interpreted(_fp8_gemm_kernel), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_args(a.device),
    )  # fmt: skip
    return c


@functools.cache
def _rowwise_capable(device: torch.device) -> bool:
    """torch's row-wise scaled FP8 GEMM runs on Hopper and newer (CPUs emulate it)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (9, 0)


def scaled_mm_supported(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """torch's row-wise FP8 GEMM: per-channel weight scales, bf16 out, 16-aligned K and N."""
    n, k = weight.shape
    return (
        scale.dim() == 1
        and x.dtype == torch.bfloat16
        and k % 16 == 0
        and n % 16 == 0
        and _rowwise_capable(x.device)
    )


def fp8_linear(
    x: torch.Tensor,  # [M, K] bf16 / fp16 / fp32
    weight: torch.Tensor,  # [N, K] e4m3
    scale: torch.Tensor,  # [N] per channel, or [cdiv(N, 128), cdiv(K, 128)] per block
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    """x W^T (+ bias) with x quantized to e4m3 per token (per token and 128 columns for
    block-scaled weights) on FP8 tensor cores."""
    x = x.contiguous()
    if x.shape[0] == 0:
        return x.new_empty(0, weight.shape[0])
    if scaled_mm_supported(x, weight, scale):
        xq, xs = quantize_activations(x)
        y = torch._scaled_mm(
            xq, weight.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=x.dtype
        )
        return y if bias is None else y + bias
    group = BLOCK if scale.dim() == 2 else None
    xq, xs = quantize_activations(x, group)
    return fp8_gemm(xq, xs, weight, scale, x.dtype, bias)
