"""Linear layers that shard their own weights for tensor parallelism (plain at tp=1), in the
model dtype, in FP8 (`minisgl.layers.weight_format`) or in 4/8-bit integers with group scales
(`minisgl.layers.lowbit`).

Each parameter carries a `weight_loader(param, loaded, shard_id=None)` that copies this rank's
part of a full checkpoint tensor into it, so the loader never needs to know the layout. A layer
says where each checkpoint part goes (`_place`); the weight format says how it is stored.

FP8 layers multiply on the GPU by weight-only GEMV (the weights widened in registers, 16-bit
activations; or the skinny tensor-core GEMM with `QuantConfig.skinny`, up to 16 rows) up to
`QuantConfig.gemv_max_rows` rows, and on FP8 tensor cores with activations
quantized per token above that; elsewhere with the weights dequantized on use and the same
rounding of the activations, so the CPU path is the reference of the GPU's numerics. (At tensor-parallel
sizes above 1 a row-parallel layer's activations are quantized per rank's shard of each token:
with per-channel weights that differs from tp=1 by e4m3 rounding above the switch; block-scaled
weights quantize per 128 columns, which shards do not cut.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.config import QuantConfig, env
from minisgl.distributed import all_reduce, get_tp_info
from minisgl.kernels.fp8 import FP8_DTYPE, is_fp8, round_trip_activations
from minisgl.layers.fused import fused_kernels
from minisgl.layers.lowbit import LowBitParts, QWeight
from minisgl.layers.weight_format import (
    Place,
    copy_part,
    dequantized,
    load_fp8_weight,
    load_scale_part,
    scale_shape,
)

WeightLoader = Callable[..., None]
ShardId = str | int | None


def _param(
    shape: Sequence[int], loader: WeightLoader, dtype: torch.dtype | None = None
) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
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
    if is_fp8(loaded.dtype) and not is_fp8(param.dtype):
        raise ValueError("an FP8 checkpoint tensor reached a layer that is not quantized")
    param.data.copy_(loaded)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    _copy(param, loaded)


class LinearBase(nn.Module):
    """This rank's [out, in] weight, in the model dtype or FP8 (`quant`); subclasses say where
    checkpoint parts go (`_place`) and, for fused projections, how a fused tensor splits into
    parts (`_part_sizes`)."""

    batch_invariant = False  # `set_batch_invariant`: multiply with `invariant_linear`

    def __init__(
        self,
        in_local: int,
        out_local: int,
        bias: bool,
        quant: QuantConfig | None,
        bias_sharded: bool = True,
    ) -> None:
        super().__init__()
        self.quant = quant
        self.weight_scale: nn.Parameter | None = None
        # Integer weights: parts gathered while loading, packed for the kernels at the end.
        self.lowbit = LowBitParts(out_local, in_local, quant) if quant and quant.is_int else None
        if self.lowbit is not None:
            self.weight = self.lowbit.placeholder(self._load_weight)
        elif quant is None:
            self.weight = _weight(out_local, in_local, self._load_weight)
        else:
            self.weight = _param((out_local, in_local), self._load_weight, FP8_DTYPE)
            shape = scale_shape(out_local, in_local, quant)
            self.weight_scale = _param(shape, self._load_scale, torch.float32)
            self.weight_scale.derived = True  # type: ignore[attr-defined]
        # Parts of an FP8 weight loaded as e4m3, and parts whose scales arrived (or were made).
        self._fp8_parts: set[ShardId] = set()
        self._scaled_parts: set[ShardId] = set()
        bias_loader = self._load_bias if bias_sharded else default_weight_loader
        self.bias = _param((out_local,), bias_loader) if bias else None

    # ---- where checkpoint parts go -------------------------------------------------------------

    def _place(self, shard_id: ShardId) -> Place:
        """Where part `shard_id` of a checkpoint tensor lands in this rank's weight."""
        out, in_ = self.weight.shape
        return Place(0, out, 0, 0, in_)

    def _part_sizes(self) -> list[tuple[ShardId, int]]:
        """A checkpoint tensor's parts (several for a fused one) and their rows (unsharded)."""
        return [(None, self.weight.shape[0])]

    def _in_features(self) -> int:
        """The columns of a checkpoint tensor (unsharded)."""
        return int(self.weight.shape[1])

    def _check_part(self, part: torch.Tensor, shard_id: ShardId, what: str) -> None:
        rows = dict(self._part_sizes())[shard_id]
        want = (rows, self._in_features()) if len(part.shape) == 2 else (rows,)
        if tuple(part.shape) != want:
            raise ValueError(f"{what}: checkpoint shape {tuple(part.shape)} is not {want}")

    def _parts(
        self, loaded: torch.Tensor, shard_id: ShardId, rows_per: int = 1
    ) -> list[tuple[ShardId, torch.Tensor]]:
        """(shard id, part) pairs of a checkpoint tensor; `rows_per` rows of the weight make one
        row of `loaded` (128 for block scales). A single value (a per-tensor scale) goes to every
        part."""
        sizes = self._part_sizes()
        if shard_id is not None or len(sizes) == 1:
            return [(shard_id, loaded)]
        if loaded.numel() == 1:
            return [(sid, loaded) for sid, _ in sizes]
        rows = [-(-n // rows_per) for _, n in sizes]
        return list(zip([sid for sid, _ in sizes], loaded.split(rows, dim=0)))

    # ---- loaders ------------------------------------------------------------------------------

    def _load_weight(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: ShardId = None) -> None:  # fmt: skip
        what = f"{type(self).__name__} weight"
        for sid, part in self._parts(loaded, shard_id):
            self._check_part(part, sid, what)
            place = self._place(sid)
            if self.lowbit is not None:
                self.lowbit.add(part, place)
                continue
            if isinstance(part, QWeight):  # an integer checkpoint in a 16/32-bit or FP8 layer
                part = part.dequantize(param.dtype if self.quant is None else torch.float32)
            if self.quant is None:
                if is_fp8(part.dtype):
                    raise ValueError(f"{what}: an FP8 checkpoint tensor in an unquantized layer")
                copy_part(param.data, part, place, what)
                continue
            assert self.weight_scale is not None
            scaled = load_fp8_weight(
                param.data, self.weight_scale.data, part, place, self.quant, what
            )
            (self._scaled_parts if scaled else self._fp8_parts).add(sid)

    def _load_scale(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: ShardId = None) -> None:  # fmt: skip
        assert self.quant is not None
        rows_per = 1 if self.quant.weight_block is None else 128
        for sid, part in self._parts(loaded, shard_id, rows_per):
            place = self._place(sid)
            load_scale_part(param.data, part, place, self.quant, f"{type(self).__name__} scale")
            self._scaled_parts.add(sid)

    def _load_bias(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: ShardId = None) -> None:  # fmt: skip
        what = f"{type(self).__name__} bias"
        for sid, part in self._parts(loaded, shard_id):
            self._check_part(part, sid, what)
            copy_part(param.data, part, self._place(sid), what)

    def finish_loading(self) -> None:
        """After the last checkpoint tensor: integer weights are packed for their kernel (or
        dequantized where none takes them); every FP8 part has its scales."""
        if self.lowbit is not None:
            self.weight, self.weight_scale = self.lowbit.finish(type(self).__name__)
        unscaled = self._fp8_parts - self._scaled_parts
        if unscaled:
            raise ValueError(
                f"{type(self).__name__}: the checkpoint has FP8 weights without scales "
                f"(parts {sorted(map(str, unscaled))}); a weight_scale tensor is missing"
            )

    # ---- compute ------------------------------------------------------------------------------

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] -> x W^T + bias [..., out]. FP8 weights: up to `gemv_max_rows` rows with
        x as it is (weight-only), above that with x rounded to e4m3 per token (per token and
        128 columns for block-scaled weights), as the FP8 tensor-core GEMMs take it; the
        reference path (CPU, or CUDA without the fused kernels) rounds x the same way."""
        if self.lowbit is not None:
            return self.lowbit.matmul(x, self.weight, bias)
        if self.quant is None:
            linear = invariant_linear if self.batch_invariant else F.linear
            return linear(x, self.weight, bias)
        weight_only = x.numel() <= self.quant.gemv_max_rows * x.shape[-1]
        assert self.weight_scale is not None
        fused = fused_kernels(x)
        if fused is not None:
            shape = x.shape
            x2 = x.reshape(-1, shape[-1])
            if weight_only:
                kernel = fused.skinny if _skinny_rows(x2, self.quant) else fused.gemv
                y = kernel(x2, self.weight, bias, weight_scale=self.weight_scale)
            else:
                y = fused.fp8_linear(x2, self.weight, self.weight_scale, bias)
            return y.reshape(*shape[:-1], y.shape[-1])  # type: ignore[no-any-return]
        w = dequantized(self.weight, self.weight_scale, self.quant, x.dtype)
        if not weight_only:
            x = round_trip_activations(x, self.quant.weight_block)
        return F.linear(x, w, bias)

    def one_row(
        self,
        gemv: OneRowGemv,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        norm_weight: torch.Tensor | None = None,
        eps: float = 1e-6,
        act: bool = False,
    ) -> torch.Tensor:
        """`gemv` with this layer's weight (and bias, and FP8 scales): the batch-1 path."""
        return gemv(
            x, self.weight, self.bias, residual=residual, norm_weight=norm_weight, eps=eps,
            act=act, weight_scale=self.weight_scale,
        )  # fmt: skip


class ReplicatedLinear(LinearBase):
    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, quant: QuantConfig | None = None
    ) -> None:  # fmt: skip
        super().__init__(in_features, out_features, bias, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W split by output rows: each rank computes a slice of y."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, quant: QuantConfig | None = None
    ) -> None:  # fmt: skip
        tp = get_tp_info()
        if out_features % tp.size:
            raise ValueError(f"output size {out_features} does not divide by tp size {tp.size}")
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.out_local = out_features // tp.size
        super().__init__(in_features, self.out_local, bias, quant)

    def _place(self, shard_id: ShardId) -> Place:
        n = self.out_local
        return Place(0, n, self.tp_rank * n, 0, self.weight.shape[1])

    def _part_sizes(self) -> list[tuple[ShardId, int]]:
        return [(None, self.out_local * self.tp_size)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked (gate and up); shard_id picks the part."""

    def __init__(
        self,
        in_features: int,
        out_sizes: Sequence[int],
        bias: bool = False,
        quant: QuantConfig | None = None,
    ) -> None:
        super().__init__(in_features, sum(out_sizes), bias, quant)
        self.out_sizes = [s // self.tp_size for s in out_sizes]
        if any(s % self.tp_size for s in out_sizes):
            raise ValueError(f"sizes {out_sizes} do not divide by tp size {self.tp_size}")

    def _part_sizes(self) -> list[tuple[ShardId, int]]:
        return [(i, s * self.tp_size) for i, s in enumerate(self.out_sizes)]

    def _place(self, shard_id: ShardId) -> Place:
        assert isinstance(shard_id, int)
        n = self.out_sizes[shard_id]
        start = sum(self.out_sizes[:shard_id])
        return Place(start, n, self.tp_rank * n, 0, self.weight.shape[1])


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections split by heads; KV heads are replicated when fewer than ranks."""

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        quant: QuantConfig | None = None,
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
        super().__init__(hidden, out * tp.size, bias, quant)

    @property
    def sizes(self) -> tuple[int, int, int]:
        return (
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )

    def _part_sizes(self) -> list[tuple[ShardId, int]]:
        q, k, _ = self.sizes
        nkv = k * self.tp_size // self.kv_replicas
        return [("q", q * self.tp_size), ("k", nkv), ("v", nkv)]

    def _place(self, shard_id: ShardId) -> Place:
        q, k, _ = self.sizes
        cols = self.weight.shape[1]
        if shard_id == "q":
            return Place(0, q, self.tp_rank * q, 0, cols)
        assert shard_id in ("k", "v")
        start = q if shard_id == "k" else q + k
        return Place(start, k, (self.tp_rank // self.kv_replicas) * k, 0, cols)


class RowParallelLinear(LinearBase):
    """y = x W^T with W split by input columns; partial sums are all-reduced across ranks."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, quant: QuantConfig | None = None
    ) -> None:  # fmt: skip
        tp = get_tp_info()
        if in_features % tp.size:
            raise ValueError(f"input size {in_features} does not divide by tp size {tp.size}")
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.in_local = in_features // tp.size
        super().__init__(self.in_local, out_features, bias, quant, bias_sharded=False)

    def _place(self, shard_id: ShardId) -> Place:
        n = self.in_local
        return Place(0, self.weight.shape[0], 0, self.tp_rank * n, n)

    def _in_features(self) -> int:
        return self.in_local * self.tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(self.matmul(x, None))
        return y if self.bias is None else y + self.bias


# Rows per matmul of the batch-invariant CPU path: MKL picks its kernel (and so the order of
# each row's sums) by the row count, but matmuls of one shape sum every row alike, wherever it
# sits (1.3-2.5x the time of one F.linear on a 2-core x86 CPU).
INVARIANT_BLOCK_ROWS = 16


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] W^T [K, N] (+ bias) with each row's sums independent of the other rows: on
    CUDA one Triton GEMM tiling whatever the row count (`minisgl.kernels.gemv.invariant`),
    elsewhere batched matmuls of exactly `INVARIANT_BLOCK_ROWS` rows (the last block padded)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x.is_cuda or fused_kernels(x) is not None:  # (the latter: the interpreter in tests)
        from minisgl.kernels.gemv.invariant import invariant_matmul

        y = invariant_matmul(x2, weight)
    else:
        m, rows, w = x2.shape[0], INVARIANT_BLOCK_ROWS, weight.t()  # w [K, N]
        blocks = F.pad(x2, (0, 0, 0, -m % rows)).view(-1, rows, x2.shape[1])
        y = torch.bmm(blocks, w.expand(blocks.shape[0], *w.shape)).flatten(0, 1)[:m]
    y = y if bias is None else y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


def set_batch_invariant(model: nn.Module) -> None:
    """Every layer of `model` with a batch-invariant path (a `batch_invariant` attribute:
    linears, the LM head, decoder layers' one-row kernels) takes it: `--deterministic`."""
    for m in model.modules():
        if hasattr(type(m), "batch_invariant"):
            m.batch_invariant = True  # type: ignore[assignment]


class OneRowGemv(Protocol):
    """`minisgl.kernels.gemv.gemv.gemv` (one row of x) or `minisgl.kernels.gemv.skinny.skinny` (1..16
    rows): y = epilogue(W prologue(x)), the same call."""

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        norm_weight: torch.Tensor | None = None,
        eps: float = 1e-6,
        act: bool = False,
        weight_scale: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


@functools.cache
def _one_row_disabled() -> bool:
    """`MINISGL_DISABLE_ONE_ROW_GEMV` (A/B runs), read once: when a layer first asks."""
    return env.DISABLE_ONE_ROW_GEMV.get()


SKINNY_MAX_ROWS = 16  # what the skinny GEMM takes (`minisgl.kernels.gemv.skinny.MAX_ROWS`)


def _skinny_rows(x: torch.Tensor, quant: QuantConfig | None) -> bool:
    """FP8 weight-only rows (1..gemv_max_rows) that the skinny GEMM takes instead of the GEMV."""
    rows = x.shape[0]
    limit = min(quant.gemv_max_rows, SKINNY_MAX_ROWS) if quant is not None and quant.skinny else 0
    return 1 <= rows <= limit


def one_row_gemv(
    x: torch.Tensor, quant: QuantConfig | None = None, skinny_max_rows: int = 0
) -> OneRowGemv | None:
    """The fused few-row kernel for `x` ([M, K]) when a layer of this format should use it,
    where the fused kernels run (CUDA) and without tensor parallelism (the row-parallel
    projections would need their all-reduce between the product and the residual add):
    one row: the GEMV (or, for FP8 with `quant.skinny`, the skinny GEMM); 2..`skinny_max_rows`
    rows of unquantized weights, or FP8 weight-only rows with `quant.skinny`: the skinny GEMM.
    None: use the layers as they are (also with `MINISGL_DISABLE_ONE_ROW_GEMV=1`, for A/B
    runs)."""
    if x.dim() != 2 or get_tp_info().size != 1 or _one_row_disabled() or (quant and quant.is_int):
        return None
    fused = fused_kernels(x)
    if fused is None:
        return None
    rows = x.shape[0]
    few = 2 <= rows <= min(skinny_max_rows, SKINNY_MAX_ROWS)
    if _skinny_rows(x, quant) or (quant is None and few):
        return fused.skinny  # type: ignore[no-any-return]
    return fused.gemv if rows == 1 else None  # type: ignore[no-any-return]
