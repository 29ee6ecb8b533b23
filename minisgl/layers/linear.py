"""Linear layers that shard their own weights for tensor parallelism (plain at tp=1).

Each parameter carries a `weight_loader(param, loaded, shard_id=None)` that copies this rank's
part of a full checkpoint tensor into it, so the loader never needs to know the layout.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import all_reduce, get_tp_info
from minisgl.layers.fused import fused_kernels

WeightLoader = Callable[..., None]


def _param(shape: Sequence[int], loader: WeightLoader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


def _weight(out_features: int, in_features: int, loader: WeightLoader) -> nn.Parameter:
    """A [out, in] weight. On a CPU its memory is [in, out] (a transposed view): MKL's sgemm
    then reads it without repacking it on every call, 1.4-2x faster for the 8-64 rows of a
    decode step and the same results (bit-identical from 32 rows). Loaders copy into the view,
    so they never see the difference."""
    w = torch.empty(out_features, in_features)
    if w.device.type == "cpu":
        w = torch.empty(in_features, out_features).t()
    p = nn.Parameter(w, requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


def _copy(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(loaded)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    _copy(param, loaded)


class ReplicatedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _weight(out_features, in_features, default_weight_loader)
        self.bias = _param((out_features,), default_weight_loader) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split by output rows: each rank computes a slice of y."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        tp = get_tp_info()
        if out_features % tp.size:
            raise ValueError(f"output size {out_features} does not divide by tp size {tp.size}")
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.out_local = out_features // tp.size
        self.weight = _weight(self.out_local, in_features, self._load)
        self.bias = _param((self.out_local,), self._load) if bias else None

    def _load(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        n = self.out_local
        _copy(param, loaded.narrow(0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked (gate and up); shard_id picks the part."""

    def __init__(self, in_features: int, out_sizes: Sequence[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(out_sizes), bias)
        self.out_sizes = [s // self.tp_size for s in out_sizes]
        if any(s % self.tp_size for s in out_sizes):
            raise ValueError(f"sizes {out_sizes} do not divide by tp size {self.tp_size}")

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:  # already merged in the checkpoint
            parts = loaded.split([s * self.tp_size for s in self.out_sizes], dim=0)
            for i, part in enumerate(parts):
                self._load(param, part, i)
            return
        n = self.out_sizes[shard_id]
        start = sum(self.out_sizes[:shard_id])
        _copy(param.data.narrow(0, start, n), loaded.narrow(0, self.tp_rank * n, n))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections split by heads; KV heads are replicated when fewer than ranks."""

    def __init__(
        self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        tp = get_tp_info()
        if num_heads % tp.size:
            raise ValueError(f"{num_heads} attention heads do not divide by tp size {tp.size}")
        if num_kv_heads >= tp.size and num_kv_heads % tp.size:
            raise ValueError(f"{num_kv_heads} KV heads do not divide by tp size {tp.size}")
        if num_kv_heads < tp.size and tp.size % num_kv_heads:
            raise ValueError(f"tp size {tp.size} is not a multiple of {num_kv_heads} KV heads")
        self.head_dim = head_dim
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = max(1, num_kv_heads // tp.size)
        # Ranks that share one replicated KV head.
        self.kv_replicas = max(1, tp.size // num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden, out * tp.size, bias)

    @property
    def sizes(self) -> tuple[int, int, int]:
        return (
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        q, k, _ = self.sizes
        if shard_id is None:  # a checkpoint with fused qkv
            nq, nkv = q * self.tp_size, k * self.tp_size // self.kv_replicas
            for sid, part in zip("qkv", loaded.split([nq, nkv, nkv], dim=0)):
                self._load(param, part, sid)
            return
        if shard_id == "q":
            start, n, rank = 0, q, self.tp_rank
        else:
            start, n = (q if shard_id == "k" else q + k), k
            rank = self.tp_rank // self.kv_replicas
        _copy(param.data.narrow(0, start, n), loaded.narrow(0, rank * n, n))


class RowParallelLinear(nn.Module):
    """y = x W^T with W split by input columns; partial sums are all-reduced across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        tp = get_tp_info()
        if in_features % tp.size:
            raise ValueError(f"input size {in_features} does not divide by tp size {tp.size}")
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.in_local = in_features // tp.size
        self.weight = _weight(out_features, self.in_local, self._load)
        self.bias = _param((out_features,), default_weight_loader) if bias else None

    def _load(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        n = self.in_local
        _copy(param, loaded.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class OneRowGemv(Protocol):
    """`minisgl.kernels.gemv.gemv`: y = epilogue(W prologue(x)) for a one-row x."""

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        norm_weight: torch.Tensor | None = None,
        eps: float = 1e-6,
        act: bool = False,
    ) -> torch.Tensor: ...


ENV_DISABLE_ONE_ROW = "MINISGL_DISABLE_ONE_ROW_GEMV"
_ONE_ROW = os.environ.get(ENV_DISABLE_ONE_ROW) != "1"


def one_row_gemv(x: torch.Tensor) -> OneRowGemv | None:
    """The fused one-row GEMV for `x` when a layer should use it: one token where the fused
    kernels run (CUDA), and no tensor parallelism (the row-parallel projections would need their
    all-reduce between the product and the residual add). None: use the layers as they are
    (also with `MINISGL_DISABLE_ONE_ROW_GEMV=1`, for A/B runs)."""
    if not _ONE_ROW or x.dim() != 2 or x.shape[0] != 1 or get_tp_info().size != 1:
        return None
    fused = fused_kernels(x)
    if fused is None:
        return None
    return fused.gemv  # type: ignore[no-any-return]
