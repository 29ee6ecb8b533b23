"""Low-bit integer weights (4 or 8 bits) with per-group scales and mins, the one layout every
GGUF / AWQ / GPTQ / compressed-tensors format converts to at load:

    w[n, k] = scales[n, k // group] * q[n, k] + mins[n, k // group],   q unsigned (0..2^bits-1)

(a signed or zero-point format folds its offset into `mins`), and, for GPTQ's `desc_act`, a
column permutation: stored column j is input column `perm[j]`, so the layer gathers x's columns
once and every group is contiguous. The CPU kernel is torch's `_weight_int4pack_mm_for_cpu`
(`cpu`); the CUDA kernels are Triton (`triton`). Importing this package does not import Triton.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

GROUPS = (16, 32, 64, 128, 256)  # group sizes a layer takes (Q6_K: 16; the kernels: 32..256)


class QWeight(NamedTuple):
    """One [N, K] low-bit weight (or a part of one) in the common layout."""

    q: torch.Tensor  # [N, K] uint8, unsigned values
    scales: torch.Tensor  # [N, K // group] fp32
    mins: torch.Tensor  # [N, K // group] fp32
    perm: torch.Tensor | None = None  # [K] int64: stored column j is input column perm[j]

    @property
    def group(self) -> int:
        return int(self.q.shape[1] // self.scales.shape[1])

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [N, K] values it stands for, in input-column order."""
        g = self.group
        w = self.q.float() * self.scales.repeat_interleave(g, 1) + self.mins.repeat_interleave(g, 1)
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm.to(w.device), w)
        return w.to(dtype)

    def narrow(self, rows: tuple[int, int], cols: tuple[int, int]) -> QWeight:
        """Rows [r0, r0 + n) and columns [c0, c0 + k) (group edges; no permutation)."""
        g = self.group
        if cols != (0, self.q.shape[1]) and (self.perm is not None or cols[0] % g or cols[1] % g):
            raise ValueError(
                f"a tensor-parallel shard at column {cols[0]} cuts a quantization group of {g} "
                "(or a desc_act permutation); use a smaller tp size"
            )
        r0, n = rows
        c0, k = cols
        return QWeight(
            self.q.narrow(0, r0, n).narrow(1, c0, k),
            self.scales.narrow(0, r0, n).narrow(1, c0 // g, k // g),
            self.mins.narrow(0, r0, n).narrow(1, c0 // g, k // g),
            self.perm,
        )

    def regroup(self, group: int) -> QWeight:
        """The same values with `group` (a divisor of this group) columns per scale."""
        r = self.group // group
        return self._replace(
            scales=self.scales.repeat_interleave(r, 1), mins=self.mins.repeat_interleave(r, 1)
        )

    def bits(self) -> int:
        return 4 if int(self.q.max()) < 16 else 8


def pick_group(cols: int, group: int) -> int:
    """The largest group up to `group` that divides `cols` (576 columns: 64 for 128)."""
    while group > GROUPS[0] and cols % group:
        group //= 2
    if cols % group:
        raise ValueError(f"{cols} columns do not split into groups of {GROUPS[0]} or more")
    return group


def quantize_rtn(w: torch.Tensor, bits: int, group: int) -> QWeight:
    """Round-to-nearest per group, asymmetric (each group's min and max are exact)."""
    n, k = w.shape
    g = pick_group(k, group)
    wg = w.float().reshape(n, k // g, g)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scales = (hi - lo) / (2**bits - 1)
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    q = ((wg - lo[..., None]) * inv[..., None]).round_().clamp_(0, 2**bits - 1)
    return QWeight(q.to(torch.uint8).reshape(n, k), scales, lo)


def join(parts: list[QWeight]) -> QWeight:
    """Parts stacked by rows (q / k / v, gate / up) at their common group; one permutation."""
    perms = {None if p.perm is None else tuple(p.perm.tolist()) for p in parts}
    if len(perms) > 1:
        raise ValueError("fused projections with different desc_act permutations")
    group = math.gcd(*(p.group for p in parts))
    parts = [p.regroup(group) for p in parts]
    return QWeight(
        torch.cat([p.q for p in parts]),
        torch.cat([p.scales for p in parts]),
        torch.cat([p.mins for p in parts]),
        parts[0].perm,
    )
