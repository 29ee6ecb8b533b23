"""Rotary position embedding (neox / rotate-half layout), with llama3, linear and yarn scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from minisgl.attention.base import KVStore
from minisgl.config import RopeConfig
from minisgl.layers.fused import fused_kernels
from minisgl.layers.norm import RMSNorm


def _inv_freq(dim: int, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] and the attention scale that the scaling kind implies."""
    # fp32 like the reference implementation, so positions map to bit-identical angles.
    base = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.kind in ("default", "dynamic"):
        return base, 1.0
    if rope.kind == "linear":
        return base / rope.factor, 1.0
    if rope.kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / base
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        blended = (1 - smooth) * base / rope.factor + smooth * base
        out = torch.where(wavelen > low_wavelen, base / rope.factor, blended)
        out = torch.where(wavelen < high_wavelen, base, out)
        return out, 1.0
    if rope.kind == "yarn":
        # YaRN (Peng et al. 2023): interpolate low frequencies, extrapolate high ones.
        def corr_dim(rot: float) -> float:
            return (dim * math.log(rope.original_max_position / (rot * 2 * math.pi))) / (
                2 * math.log(rope.theta)
            )

        low = max(math.floor(corr_dim(rope.beta_fast)), 0)
        high = min(math.ceil(corr_dim(rope.beta_slow)), dim - 1)
        if low == high:
            high = high + 0.001  # type: ignore[assignment]
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolate = 1 - ramp
        out = base / rope.factor * (1 - extrapolate) + base * extrapolate
        mscale = 0.1 * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0
        return out, mscale
    raise ValueError(f"rope scaling type {rope.kind!r} is not supported")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig) -> None:
        super().__init__()
        inv_freq, mscale = _inv_freq(head_dim, rope)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())  # [max_position, head_dim/2]
        cache = torch.cat([freqs.cos() * mscale, freqs.sin() * mscale], dim=-1)
        self.register_buffer("cos_sin", cache, persistent=False)  # [max_pos, head_dim]

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
        rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, Hq, D], k [T, Hkv, D] -> rotated q, k (same dtypes). With
        `q_norm` and `k_norm` (Qwen3) each head is RMS-normalised first; on CUDA the norms and
        the rotation are one fused kernel. `rows`: `lookup(positions)`, when the caller looked
        them up once for all layers."""
        q, k_rot = self.rotate_and_store(positions, q, k, None, None, q_norm, k_norm, rows)
        assert k_rot is not None  # only a store keeps k
        return q, k_rot

    def rotate_and_store(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        store: KVStore | None,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
        rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, and with a `store` (the backend's `kv_store`) and `v` on the fused path,
        the rotated k and v written into the KV pool by the same kernel: k comes back None then.
        Otherwise (k, v) are left to the attention backend to store."""
        table: torch.Tensor = self.cos_sin  # type: ignore[assignment]
        fused = fused_kernels(q)
        if fused is not None and _fusable(fused, q, k, table, q_norm, k_norm):
            qw = None if q_norm is None else q_norm.weight
            kw = None if k_norm is None else k_norm.weight
            eps = 0.0 if q_norm is None else q_norm.eps
            if store is None or v is None:
                return fused.qk_norm_rope(positions, q, k, table, qw, kw, eps)  # type: ignore[no-any-return]
            kv = (store.k_cache, store.v_cache, store.loc)
            return fused.qk_norm_rope(  # type: ignore[no-any-return]
                positions, q, k, table, qw, kw, eps, v, kv, store.scales, store.k_shift
            )
        if q_norm is not None and k_norm is not None:
            q, k = q_norm.norm(q), k_norm.norm(k)
        cos, sin = rows if rows is not None else self.lookup(positions)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> [T, 1, D] rows (cos | cos) and (-sin | sin) of the torch path."""
        table: torch.Tensor = self.cos_sin  # type: ignore[assignment]
        cos, sin = table[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each
        return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def _fusable(
    fused: object,
    q: torch.Tensor,
    k: torch.Tensor,
    table: torch.Tensor,
    q_norm: RMSNorm | None,
    k_norm: RMSNorm | None,
) -> bool:
    if (q_norm is None) != (k_norm is None):
        return False
    if q_norm is not None and k_norm is not None and q_norm.eps != k_norm.eps:
        return False
    return (
        fused.rotary_supported(q.shape[-1])  # type: ignore[attr-defined]
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and table.dtype == torch.float32
        and table.is_contiguous()
    )


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin in fp32: halves x1*cos - x2*sin | x2*cos + x1*sin, the
    same roundings as the reference in fewer ops."""
    h = x.float()
    h1, h2 = h.chunk(2, dim=-1)
    swapped = torch.cat([h2, h1], dim=-1).mul_(signed_sin)
    return (h * cos).add_(swapped).to(x.dtype)
