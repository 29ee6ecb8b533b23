"""Low-bit weights on the CPU through torch's `_weight_int4pack_mm_for_cpu`: bf16 activations
and bf16 scales (its fast path; fp32 and fp16 activations take a reference loop 15-30x slower
than fp32 `F.linear`), accumulated in fp32, output rounded to bf16. On a 2-core AVX-512 VM it reads SmolLM2-135M's layers at 1.0-1.9x the speed
of fp32 `F.linear` for 1-8 rows, 0.85-0.95x at 64-256, and its LM head 4.6x faster at one row.
8-bit values run as two 4-bit halves in one call (q = 16 hi + lo: the rows [W_hi; W_lo] summed),
the same bytes as int8 with group scales, which `_weight_int8pack_mm` (per channel) lacks.
"""

from __future__ import annotations

import torch

from minisgl.kernels.lowbit import QWeight

KERNEL_GROUPS = (32, 64, 128, 256)


class CpuLowBit:
    """A QWeight packed for the CPU kernel; `__call__(x [..., K], bias) -> [..., N]` in x's
    dtype."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, w: QWeight) -> None:
        self.packed = packed  # [N or 2N, K / 2] uint8, the kernel's tile layout
        self.scales = scales  # [K / group, N or 2N, 2] bf16: scale, zero
        self.group = w.group
        self.rows = int(w.q.shape[0])
        self.perm = w.perm

    @staticmethod
    def supports(w: QWeight) -> bool:
        n, k = w.q.shape
        return w.group in KERNEL_GROUPS and n % 16 == 0 and k % w.group == 0

    @classmethod
    def pack(cls, w: QWeight) -> CpuLowBit:
        q, s, m = w.q.int(), w.scales, w.mins
        if w.bits() == 4:  # (q - 8) s + (m + 8 s)
            q4, s4, z4 = q, s, m + 8 * s
        else:  # hi: (hi - 8) 16 s; lo: (lo - 8) s + (m + 136 s)
            q, m = _centered(q, s, m, w.group)
            q4 = torch.cat([q >> 4, q & 15])
            s4, z4 = torch.cat([16 * s, s]), torch.cat([torch.zeros_like(s), m + 136 * s])
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1)
        scales_zeros = torch.stack([s4, z4], -1).transpose(0, 1).contiguous().bfloat16()
        return cls(packed, scales_zeros, w)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if self.perm is not None:
            x2 = x2[:, self.perm]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2.bfloat16(), self.packed, self.group, self.scales
        )
        if y.shape[1] != self.rows:  # 8-bit: the two halves
            y = y[:, : self.rows].float() + y[:, self.rows :]
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.rows)
        return y if bias is None else y + bias


def _centered(
    q: torch.Tensor, s: torch.Tensor, m: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's values shifted to sit around 128 (q + c, m - c s: the same weights), so the
    bf16 zero point of the low half stays near the group's own values (a 5-bit group's would
    otherwise carry ~120 s, rounded to 2^-9 of that)."""
    n, k = q.shape
    top = q.view(n, k // group, group).amax(-1).clamp(min=1).float()
    c = 128 - torch.exp2(torch.floor(torch.log2(top)))  # 128 - 2^(bits - 1)
    return q + c.int().repeat_interleave(group, 1), m - c * s
