"""Mixture-of-experts MLP: a replicated router picks each token's top-k experts; SwiGLU experts
are stacked into two tensors and sharded along their intermediate dimension for tensor
parallelism, so each rank holds a slice of every expert and one all-reduce ends the layer.

On CUDA with Triton installed the experts run as the fused grouped-GEMM kernels of
`minisgl.kernels.moe`; everywhere else as `moe_reference` below (the math both must match). A
batch-1 decode step on CUDA takes `forward_one_row`: the whole layer, its norm and residual add
included, in three kernels.

FP8 experts (`QuantConfig`) hold e4m3 stacks with fp32 scales per output row or per 128 x 128
block (`minisgl.layers.weight_format`); the fused kernels widen them in registers, the reference
dequantizes each expert it uses.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.config import QuantConfig
from minisgl.distributed import all_reduce, get_tp_info
from minisgl.kernels.fp8 import FP8_DTYPE, ExpertScales, is_fp8
from minisgl.layers.fused import fused_kernels
from minisgl.layers.linear import ReplicatedLinear
from minisgl.layers.norm import RMSNorm
from minisgl.layers.weight_format import (
    Place,
    copy_part,
    load_fp8_weight,
    load_scale_part,
    scale_shape,
)

# x [T, H], w13 [E, 2I, H], w2 [E, H, I], router logits [T, E], top_k, renormalize, the FP8
# experts' scales -> [T, H]
MoEImpl = Callable[..., torch.Tensor]


class Routing(NamedTuple):
    """The experts each token goes to and the weight of each one's output."""

    weights: torch.Tensor  # [T, K] fp32
    ids: torch.Tensor  # [T, K] int64


def select_experts(logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """Softmax over all experts in fp32, keep the top k; renormalise them to sum to 1 if asked.

    logits [T, E] in any dtype.
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, K]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights, ids)


def moe_reference(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H] gate rows then up rows
    w2: torch.Tensor,  # [E, H, I]
    routing: Routing,
    scales: ExpertScales | None = None,  # e4m3 experts
) -> torch.Tensor:  # [T, H] in x.dtype
    """sum_k weight_k * down_e(silu(gate_e(x)) * up_e(x)) over each token's experts e = ids_k.

    One matmul pair per expert that has tokens; products in x.dtype, the sum over k in fp32.
    FP8 experts are dequantized one at a time, to x.dtype.
    """
    num_tokens, top_k = routing.ids.shape
    flat_ids = routing.ids.reshape(-1)  # [T*K]
    order = torch.argsort(flat_ids, stable=True)  # [T*K] (token, k) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()  # host sync: reference
    flat_weights = routing.weights.reshape(-1)  # [T*K]
    # Every pair is written once; a buffer per pair avoids index_add_, which is slow on CPU.
    per_pair = torch.empty(num_tokens * top_k, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        rows = order[start : start + n]  # [n] indices into the flattened (token, k) pairs
        start += n
        if n == 0:
            continue
        w_gate_up, w_down = _expert(w13, w2, scales, e, x.dtype)
        gate, up = F.linear(x[rows // top_k], w_gate_up).chunk(2, dim=-1)  # [n, I] each
        h = F.linear(F.silu(gate) * up, w_down)  # [n, H]
        per_pair[rows] = h.float() * flat_weights[rows, None]
    return per_pair.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)


def _expert(
    w13: torch.Tensor, w2: torch.Tensor, scales: ExpertScales | None, e: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e's [2I, H] and [H, I] weights in `dtype` (dequantized if FP8)."""
    if scales is None:
        return w13[e], w2[e]
    block = None if scales.w13.dim() == 2 else 128
    return (
        (w13[e].float() * _expand(scales.w13[e], w13.shape[1:], block)).to(dtype),
        (w2[e].float() * _expand(scales.w2[e], w2.shape[1:], block)).to(dtype),
    )


def _expand(scale: torch.Tensor, shape: torch.Size, block: int | None) -> torch.Tensor:
    if block is None:
        return scale[:, None]
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
    return full[: shape[0], : shape[1]]


def _reference_impl(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    config: object = None,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    return moe_reference(x, w13, w2, select_experts(logits, top_k, renormalize), scales)


@functools.cache
def moe_impl(device_type: str) -> MoEImpl:
    """The fused Triton kernels on CUDA when Triton is installed, the torch reference otherwise."""
    if device_type == "cuda" and importlib.util.find_spec("triton") is not None:
        from minisgl.kernels.moe.layer import fused_moe

        return fused_moe
    return _reference_impl


class MoEExperts(nn.Module):
    """Every expert's SwiGLU weights, stacked; this rank holds the slice
    [rank * I_local, (rank + 1) * I_local) of each expert's intermediate dimension.

    Checkpoints give one tensor per expert and projection; their loaders take
    `shard_id = (expert, 0 | 1)` for gate | up and `shard_id = expert` for down (their FP8
    scales likewise). Without a shard id a loader takes the whole stack (`[E, 2I, H]` gate then
    up, or `[E, H, I]`).
    """

    def __init__(
        self, num_experts: int, hidden: int, intermediate: int, quant: QuantConfig | None = None
    ) -> None:
        super().__init__()
        tp = get_tp_info()
        if intermediate % tp.size:
            raise ValueError(
                f"moe_intermediate_size {intermediate} does not divide by tp size {tp.size}"
            )
        self.num_experts, self.hidden = num_experts, hidden
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.local = intermediate // tp.size
        if quant is not None and quant.is_int:  # integer experts have no kernel: model dtype
            quant = None
        self.quant = quant
        dtype = None if quant is None else FP8_DTYPE
        # [E, 2 * I_local, H]: gate rows, then up rows, of this rank's slice
        self.gate_up_proj = _param((num_experts, 2 * self.local, hidden), self._load_gate_up, dtype)
        # [E, H, I_local]
        self.down_proj = _param((num_experts, hidden, self.local), self._load_down, dtype)
        self.gate_up_proj_scale: nn.Parameter | None = None
        self.down_proj_scale: nn.Parameter | None = None
        if quant is not None:
            self.gate_up_proj_scale = _scale_param(
                num_experts, scale_shape(2 * self.local, hidden, quant), self._load_gate_up_scale
            )
            self.down_proj_scale = _scale_param(
                num_experts, scale_shape(hidden, self.local, quant), self._load_down_scale
            )
        # (stack, expert, part) of FP8 weights loaded as e4m3, and of the scales that arrived
        self._fp8_parts: set[tuple[str, int, int]] = set()
        self._scaled_parts: set[tuple[str, int, int]] = set()

    @property
    def scales(self) -> ExpertScales | None:
        """The FP8 stacks' scales; None for 16/32-bit experts."""
        if self.gate_up_proj_scale is None or self.down_proj_scale is None:
            return None
        return ExpertScales(self.gate_up_proj_scale, self.down_proj_scale)

    def _gate_up_place(self, part: int) -> Place:
        n = self.local
        return Place(part * n, n, self.tp_rank * n, 0, self.hidden)

    def _down_place(self) -> Place:
        n = self.local
        return Place(0, self.hidden, 0, self.tp_rank * n, n)

    def _check(self, what: str, loaded: torch.Tensor, shape: tuple[int, ...]) -> None:
        if tuple(loaded.shape) != shape:
            raise ValueError(f"expert {what} weight shape {tuple(loaded.shape)} is not {shape}")

    def _store(
        self, stack: str, param: torch.Tensor, expert: int, part: int, loaded: torch.Tensor, place: Place
    ) -> None:  # fmt: skip
        """One expert's part into `param[expert]` (quantized if FP8)."""
        what = f"expert {stack}"
        if self.quant is None:
            if is_fp8(loaded.dtype):
                raise ValueError(f"{what}: an FP8 checkpoint tensor in unquantized experts")
            copy_part(param.data[expert], loaded, place, what)
            return
        scale = getattr(self, f"{stack}_scale")
        scaled = load_fp8_weight(param.data[expert], scale.data[expert], loaded, place, self.quant, what)  # fmt: skip
        (self._scaled_parts if scaled else self._fp8_parts).add((stack, expert, part))

    def _load_gate_up(
        self, param: torch.Tensor, loaded: torch.Tensor, shard_id: tuple[int, int] | None = None
    ) -> None:
        full = self.local * self.tp_size
        if shard_id is None:  # the whole stack [E, 2I, H]: gate rows, then up rows
            self._check("gate_up", loaded, (self.num_experts, 2 * full, self.hidden))
            for expert in range(self.num_experts):
                for part in (0, 1):
                    rows = loaded[expert].narrow(0, part * full, full)
                    self._store("gate_up_proj", param, expert, part, rows, self._gate_up_place(part))  # fmt: skip
            return
        expert, part = shard_id
        self._check("gate/up", loaded, (full, self.hidden))  # [I, H]
        self._store("gate_up_proj", param, expert, part, loaded, self._gate_up_place(part))

    def _load_down(
        self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None
    ) -> None:
        full = self.local * self.tp_size
        if shard_id is None:  # the whole stack [E, H, I]
            self._check("down", loaded, (self.num_experts, self.hidden, full))
            for expert in range(self.num_experts):
                self._store("down_proj", param, expert, 0, loaded[expert], self._down_place())
            return
        self._check("down", loaded, (self.hidden, full))  # [H, I]
        self._store("down_proj", param, shard_id, 0, loaded, self._down_place())

    def _load_gate_up_scale(
        self, param: torch.Tensor, loaded: torch.Tensor, shard_id: tuple[int, int]
    ) -> None:
        assert self.quant is not None
        expert, part = shard_id
        place = self._gate_up_place(part)
        load_scale_part(param.data[expert], loaded, place, self.quant, "expert gate/up scale")
        self._scaled_parts.add(("gate_up_proj", expert, part))

    def _load_down_scale(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int) -> None:
        assert self.quant is not None
        load_scale_part(param.data[shard_id], loaded, self._down_place(), self.quant, "expert down scale")  # fmt: skip
        self._scaled_parts.add(("down_proj", shard_id, 0))

    def finish_loading(self) -> None:
        """After the last checkpoint tensor: every FP8 part has its scales."""
        unscaled = self._fp8_parts - self._scaled_parts
        if unscaled:
            raise ValueError(
                f"the checkpoint has FP8 expert weights without scales, e.g. {min(unscaled)}"
            )


def _param(
    shape: tuple[int, int, int], loader: Callable[..., None], dtype: torch.dtype | None = None
) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


def _scale_param(num_experts: int, shape: tuple[int, ...], loader: Callable[..., None]) -> nn.Parameter:  # fmt: skip
    """An FP8 stack's fp32 scales: set by the checkpoint, or when its weights are quantized."""
    p = nn.Parameter(torch.empty(num_experts, *shape, dtype=torch.float32), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    p.derived = True  # type: ignore[attr-defined]
    return p


class SparseMoeBlock(nn.Module):
    """Router + experts; at tp > 1 each rank adds its experts' partial sums in one all-reduce."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        intermediate: int,
        renormalize: bool,
        quant: QuantConfig | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in [1, {num_experts}]")
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = ReplicatedLinear(hidden, num_experts)  # the router: [E, H], never FP8
        self.experts = MoEExperts(num_experts, hidden, intermediate, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        logits = self.gate(x)  # [T, E]
        impl = moe_impl(x.device.type)
        experts = self.experts
        out = impl(
            x, experts.gate_up_proj, experts.down_proj, logits, self.top_k, self.renormalize,
            None, experts.scales,
        )  # fmt: skip
        return all_reduce(out)

    def forward_one_row(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """x + self(norm(x)) for one token where the one-row GEMV path runs (fused kernels, tp
        1; see `DecoderLayer.forward_one_row`): `minisgl.kernels.moe.one_row_moe`, three
        launches with the norm and the residual add inside them."""
        fused = fused_kernels(x)
        assert fused is not None and self.experts.tp_size == 1 and self.gate.bias is None
        experts = self.experts
        return fused.one_row_moe(  # type: ignore[no-any-return]
            x, self.gate.weight, experts.gate_up_proj, experts.down_proj, self.top_k,
            self.renormalize, norm.weight, norm.eps, scales=experts.scales,
        )  # fmt: skip
