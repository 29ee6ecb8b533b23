"""Mixture-of-experts MLP: a replicated router picks each token's top-k experts; SwiGLU experts
are stacked into two tensors and sharded along their intermediate dimension for tensor
parallelism, so each rank holds a slice of every expert and one all-reduce ends the layer.

On CUDA with Triton installed the experts run as the fused grouped-GEMM kernels of
`minisgl.kernels.moe`; everywhere else as `moe_reference` below (the math both must match). A
batch-1 decode step on CUDA takes `forward_one_row`: the whole layer, its norm and residual add
included, in three kernels.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import all_reduce, get_tp_info
from minisgl.layers.fused import fused_kernels
from minisgl.layers.linear import ReplicatedLinear
from minisgl.layers.norm import RMSNorm

# x [T, H], w13 [E, 2I, H], w2 [E, H, I], router logits [T, E], top_k, renormalize -> [T, H]
MoEImpl = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, bool], torch.Tensor
]


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
) -> torch.Tensor:  # [T, H] in x.dtype
    """sum_k weight_k * down_e(silu(gate_e(x)) * up_e(x)) over each token's experts e = ids_k.

    One matmul pair per expert that has tokens; products in x.dtype, the sum over k in fp32.
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
        gate, up = F.linear(x[rows // top_k], w13[e]).chunk(2, dim=-1)  # [n, I] each
        h = F.linear(F.silu(gate) * up, w2[e])  # [n, H]
        per_pair[rows] = h.float() * flat_weights[rows, None]
    return per_pair.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)


def _reference_impl(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
) -> torch.Tensor:
    return moe_reference(x, w13, w2, select_experts(logits, top_k, renormalize))


@functools.cache
def moe_impl(device_type: str) -> MoEImpl:
    """The fused Triton kernels on CUDA when Triton is installed, the torch reference otherwise."""
    if device_type == "cuda" and importlib.util.find_spec("triton") is not None:
        from minisgl.kernels.moe import fused_moe

        return fused_moe
    return _reference_impl


class MoEExperts(nn.Module):
    """Every expert's SwiGLU weights, stacked; this rank holds the slice
    [rank * I_local, (rank + 1) * I_local) of each expert's intermediate dimension.

    Checkpoints give one tensor per expert and projection; their loaders take
    `shard_id = (expert, 0 | 1)` for gate | up and `shard_id = expert` for down. Without a
    shard id a loader takes the whole stack (`[E, 2I, H]` gate then up, or `[E, H, I]`).
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        tp = get_tp_info()
        if intermediate % tp.size:
            raise ValueError(
                f"moe_intermediate_size {intermediate} does not divide by tp size {tp.size}"
            )
        self.num_experts, self.hidden = num_experts, hidden
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.local = intermediate // tp.size
        # [E, 2 * I_local, H]: gate rows, then up rows, of this rank's slice
        self.gate_up_proj = self._param((num_experts, 2 * self.local, hidden), self._load_gate_up)
        # [E, H, I_local]
        self.down_proj = self._param((num_experts, hidden, self.local), self._load_down)

    @staticmethod
    def _param(shape: tuple[int, int, int], loader: Callable[..., None]) -> nn.Parameter:
        p = nn.Parameter(torch.empty(*shape), requires_grad=False)
        p.weight_loader = loader  # type: ignore[attr-defined]
        return p

    def _check(self, what: str, loaded: torch.Tensor, shape: tuple[int, ...]) -> None:
        if tuple(loaded.shape) != shape:
            raise ValueError(f"expert {what} weight shape {tuple(loaded.shape)} is not {shape}")

    def _load_gate_up(
        self, param: torch.Tensor, loaded: torch.Tensor, shard_id: tuple[int, int] | None = None
    ) -> None:
        n, full = self.local, self.local * self.tp_size
        if shard_id is None:  # the whole stack [E, 2I, H]: gate rows, then up rows
            self._check("gate_up", loaded, (self.num_experts, 2 * full, self.hidden))
            for part in (0, 1):
                rows = loaded.narrow(1, part * full + self.tp_rank * n, n)  # [E, I_local, H]
                param.data[:, part * n : (part + 1) * n].copy_(rows)
            return
        expert, part = shard_id
        self._check("gate/up", loaded, (full, self.hidden))  # [I, H]
        param.data[expert, part * n : (part + 1) * n].copy_(loaded.narrow(0, self.tp_rank * n, n))

    def _load_down(
        self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None
    ) -> None:
        n, full = self.local, self.local * self.tp_size
        if shard_id is None:  # the whole stack [E, H, I]
            self._check("down", loaded, (self.num_experts, self.hidden, full))
            param.data.copy_(loaded.narrow(2, self.tp_rank * n, n))
            return
        self._check("down", loaded, (self.hidden, full))  # [H, I]
        param.data[shard_id].copy_(loaded.narrow(1, self.tp_rank * n, n))


class SparseMoeBlock(nn.Module):
    """Router + experts; at tp > 1 each rank adds its experts' partial sums in one all-reduce."""

    def __init__(
        self, hidden: int, num_experts: int, top_k: int, intermediate: int, renormalize: bool
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in [1, {num_experts}]")
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = ReplicatedLinear(hidden, num_experts)  # the router: [E, H]
        self.experts = MoEExperts(num_experts, hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        logits = self.gate(x)  # [T, E]
        impl = moe_impl(x.device.type)
        out = impl(
            x,
            self.experts.gate_up_proj,
            self.experts.down_proj,
            logits,
            self.top_k,
            self.renormalize,
        )
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
            self.renormalize, norm.weight, norm.eps,
        )  # fmt: skip
