from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.layers.fused import fused_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual): the sum is the next residual."""
        fused = fused_kernels(x)
        if fused is not None and _fusable(x, residual):
            return fused.rms_norm(x, self.weight, self.eps, residual)  # type: ignore[no-any-return]
        if residual is not None:
            x = x + residual
        residual = x
        shape = (x.shape[-1],)
        # F.rms_norm is bit-identical to x * rsqrt(mean(x^2) + eps) * weight in fp32, in one op.
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight, self.eps), residual
        # Normalise in fp32, scale in the model dtype, as the reference implementation does.
        h = F.rms_norm(x.float(), shape, eps=self.eps)
        return self.weight * h.to(x.dtype), residual

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)[0]


def _fusable(x: torch.Tensor, residual: torch.Tensor | None) -> bool:
    if x.stride(-1) != 1 or x.dim() not in (2, 3):
        return False
    return residual is None or (
        x.dim() == 2 and residual.shape == x.shape and residual.is_contiguous()
    )
