"""Integer weights on CUDA (Triton): y = x W^T (+ bias) with W = scales * q + mins per group,
W4A16 / W8A16 (x bf16 or fp16, the weights' bytes widened in registers, fp32 sums).

- one row (batch-1 decode): a GEMV, each program BLOCK_N rows over all of K; per BLOCK_K
  columns (inside one group) it sums q x and x and applies the group's scale and min to the two
  sums, so the only per-weight work is the unpack and one FMA;
- more rows: a GEMM on tensor cores, each weight tile dequantized in registers to x's dtype
  (`tl.dot`, fp32 accumulate), so prefill and large batches read int4 bytes, not bf16.

Storage: 4-bit values two to a byte ([N, K/2] uint8, column 2j in the low nibble), 8-bit one
to a byte ([N, K]); scales and mins fp16, one tensor [2, N, K / group]. Group sizes 16..256
(BLOCK_K is at most the group, so a K block never straddles two).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.common import dot, dot_flags, round_bf16
from minisgl.kernels.lowbit import GROUPS, QWeight


@triton.jit
def _gemv_kernel(x_ptr, q_ptr, sm_ptr, b_ptr, y_ptr, N, K, G,
                 GROUP: tl.constexpr, BITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if BITS == 4:
            j = tl.arange(0, BLOCK_K // 2)
            packed = tl.load(q_ptr + rows[:, None] * (K // 2) + k0 // 2 + j[None, :],
                             mask=live[:, None], other=0)  # fmt: skip
            xe = tl.load(x_ptr + k0 + 2 * j).to(tl.float32)
            xo = tl.load(x_ptr + k0 + 2 * j + 1).to(tl.float32)
            lo, hi = (packed & 15).to(tl.float32), (packed >> 4).to(tl.float32)
            qx = tl.sum(lo * xe[None, :] + hi * xo[None, :], 1)
            xs = tl.sum(xe, 0) + tl.sum(xo, 0)
        else:
            j = tl.arange(0, BLOCK_K)
            qv = tl.load(q_ptr + rows[:, None] * K + k0 + j[None, :], mask=live[:, None], other=0)
            xv = tl.load(x_ptr + k0 + j).to(tl.float32)
            qx = tl.sum(qv.to(tl.float32) * xv[None, :], 1)
            xs = tl.sum(xv, 0)
        at = rows * G + k0 // GROUP
        s = tl.load(sm_ptr + at, mask=live, other=0).to(tl.float32)
        m = tl.load(sm_ptr + N * G + at, mask=live, other=0).to(tl.float32)
        acc += qx * s + xs * m
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=live, other=0).to(tl.float32)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=live)


@triton.jit
def _gemm_kernel(x_ptr, q_ptr, sm_ptr, b_ptr, y_ptr, M, N, K, G, stride_xm, stride_ym,
                 GROUP: tl.constexpr, BITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 IEEE: tl.constexpr, EMULATE_BF16: tl.constexpr):  # fmt: skip
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=rm[:, None] < M, other=0)
        if BITS == 4:
            j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(q_ptr + rn[:, None] * (K // 2) + j[None, :],
                             mask=rn[:, None] < N, other=0)  # fmt: skip
            qv = tl.reshape(tl.join(packed & 15, packed >> 4), [BLOCK_N, BLOCK_K])
        else:
            qv = tl.load(q_ptr + rn[:, None] * K + kk[None, :], mask=rn[:, None] < N, other=0)
        at = rn * G + k0 // GROUP
        s = tl.load(sm_ptr + at, mask=rn < N, other=0).to(tl.float32)
        m = tl.load(sm_ptr + N * G + at, mask=rn < N, other=0).to(tl.float32)
        w = qv.to(tl.float32) * s[:, None] + m[:, None]  # [BLOCK_N, BLOCK_K]
        w = round_bf16(w) if EMULATE_BF16 else w.to(x_ptr.dtype.element_ty)
        acc += dot(a, tl.trans(w), IEEE, EMULATE_BF16)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0).to(tl.float32)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)  # fmt: skip


def _gemm_blocks(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) by rows: small M keeps many programs."""
    if m <= 16:
        return 16, 64, 4, 4
    if m <= 64:
        return 64, 64, 4, 4
    return 128, 128, 8, 3


class TritonLowBit:
    """A QWeight packed for the kernels; `__call__(x [..., K], bias) -> [..., N]`."""

    def __init__(self, w: QWeight) -> None:
        q = w.q
        self.bits = w.bits()
        if self.bits == 4:
            q = q[:, 0::2] | (q[:, 1::2] << 4)
        self.packed = q.contiguous()  # [N, K/2] or [N, K] uint8
        self.scales = torch.stack([w.scales, w.mins]).half().contiguous()  # [2, N, G]
        self.rows, self.cols, self.group = int(w.q.shape[0]), int(w.q.shape[1]), w.group
        self.perm = w.perm

    @staticmethod
    def supports(w: QWeight) -> bool:
        return w.group in GROUPS and w.q.shape[1] % w.group == 0

    @classmethod
    def pack(cls, w: QWeight) -> TritonLowBit:
        return cls(w)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, self.cols)
        if self.perm is not None:
            x2 = x2[:, self.perm]
        x2 = x2.contiguous()
        m, n, groups = x2.shape[0], self.rows, self.cols // self.group
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        block_k = min(self.group, 128)
        args = (x2, self.packed, self.scales, bias if bias is not None else y, y)
        meta = dict(GROUP=self.group, BITS=self.bits, HAS_BIAS=bias is not None, BLOCK_K=block_k)
        if m == 1:
            block_n = 16
            _gemv_kernel[(triton.cdiv(n, block_n),)](*args, n, self.cols, groups, BLOCK_N=block_n, **meta)  # fmt: skip
        else:
            bm, bn, warps, stages = _gemm_blocks(m)
            meta["BLOCK_K"] = min(block_k, 64)
            ieee, emulate = dot_flags(x.dtype, _gemm_kernel)
            grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
            _gemm_kernel[grid](*args, m, n, self.cols, groups, x2.stride(0), y.stride(0),
                               BLOCK_M=bm, BLOCK_N=bn, IEEE=ieee, EMULATE_BF16=emulate,
                               num_warps=warps, num_stages=stages, **meta)  # fmt: skip
        return y.reshape(*x.shape[:-1], n)
