"""Fused mixture-of-experts for CUDA (imports Triton): two paths, both without a host sync
(CUDA-graph safe); the tile table (`tiles`) picks one by the rows each expert gets on average
(T * K / E). The math is `minisgl.layers.moe.moe_reference`.

Pair path (`pair`), for a few tokens, where the step is launch- and latency-bound: two launches
after the router GEMM. Gate/up runs one program per (token, k) pair and BLOCK_N columns of I:
it routes the token itself (softmax, top-k, renormalise, as `fused_topk`), multiplies the
token's row by its expert's gate and up slices and writes silu(gate) * up; no sort, so two
tokens on one expert read it twice. Down runs one program per token and BLOCK_N columns of H,
summing routing weight x down projection over the token's experts. `one_row_moe` is this path
for one token with the RMSNorm (in the router GEMV and the gate/up kernel) and the residual add
(in the down kernel) folded in. e4m3 experts run two kernels of the same contract in the
one-row FP8 GEMV's vec layout.

Blocked path, for everything larger: `fused_topk`; `moe_align` (the T*K pairs sorted by expert,
each expert's run padded to BLOCK_M, so a block of rows has one expert); the grouped gate/up and
down GEMMs (`blocked`, or with e4m3 experts at decode sizes `w8a8`, FP8 activations too); a sum
over each token's k rows.
"""

from __future__ import annotations

import torch

from minisgl.kernels.fp8 import ExpertScales
from minisgl.kernels.gemv.gemv import gemv
from minisgl.kernels.moe import w8a8
from minisgl.kernels.moe.blocked import down_gemm, gate_up_gemm
from minisgl.kernels.moe.pair import PairRouting, pair_down, pair_gate_up, pair_tiles
from minisgl.kernels.moe.routing import fused_topk, moe_align
from minisgl.kernels.moe.tiles import ONE_ROW_CONFIG, MoEConfig, PairConfig, default_config


def _prepare(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, scales: ExpertScales | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(x, w13, w2 contiguous, the e4m3 experts' two scales or Nones), the shapes checked."""
    if w13.shape[2] != x.shape[1] or w2.shape[1] != x.shape[1] or w13.shape[1] != 2 * w2.shape[2]:
        raise ValueError(
            f"expert shapes {tuple(w13.shape)}, {tuple(w2.shape)} do not fit x {tuple(x.shape)}"
        )
    s13, s2 = scales if scales is not None else (None, None)
    return x.contiguous(), w13.contiguous(), w2.contiguous(), s13, s2


def fused_experts(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] fp32
    topk_ids: torch.Tensor,  # [T, K] int32 or int64
    config: MoEConfig | None = None,
    scales: ExpertScales | None = None,  # e4m3 experts
) -> torch.Tensor:  # [T, H] in x.dtype
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]), on the path `config` picks."""
    num_tokens, top_k = topk_ids.shape
    x, w13, w2, s13, s2 = _prepare(x, w13, w2, scales)
    if num_tokens == 0:
        return torch.zeros_like(x)
    cfg = config or default_config(num_tokens, top_k, w13.shape[0])
    ids = topk_ids.to(torch.int32).contiguous()
    weights = topk_weights.float().contiguous()
    if isinstance(cfg, PairConfig):
        routing = PairRouting(ids.view(-1), weights.view(-1))
        gate_up, down = pair_tiles(cfg, x, w13, w2)
        act, _ = pair_gate_up(x, w13, top_k, gate_up, routing=routing, scale=s13)
        return pair_down(act, w2, routing, top_k, down, scale=s2)
    if s13 is not None and s2 is not None and w8a8.use_w8a8(x, w13, cfg.block_m):
        rows = moe_align(ids, w13.shape[0], w8a8.w8a8_block_m(cfg.block_m))
        out = w8a8.w8a8_experts(x, w13, w2, (s13, s2), weights, rows)
    else:
        rows = moe_align(ids, w13.shape[0], cfg.block_m)
        act = gate_up_gemm(x, w13, rows, top_k, cfg.gate_up, s13)
        out = down_gemm(act, w2, weights, rows, cfg.down, s2)
    return out.view(num_tokens, top_k, -1).sum(dim=1)


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
    config: MoEConfig | None = None,
    scales: ExpertScales | None = None,  # e4m3 experts
) -> torch.Tensor:  # [T, H]
    """The MoE layer after its router: top-k routing, then the experts. On the pair path the
    routing runs inside the gate/up kernel (two launches in all)."""
    num_tokens = x.shape[0]
    cfg = config or default_config(num_tokens, top_k, w13.shape[0])
    if num_tokens == 0 or not isinstance(cfg, PairConfig):
        weights, ids = fused_topk(router_logits, top_k, renormalize)
        return fused_experts(x, w13, w2, weights, ids, cfg, scales)
    x, w13, w2, s13, s2 = _prepare(x, w13, w2, scales)
    gate_up, down = pair_tiles(cfg, x, w13, w2)
    act, routing = pair_gate_up(x, w13, top_k, gate_up, logits=router_logits,
                                renormalize=renormalize, scale=s13)  # fmt: skip
    return pair_down(act, w2, routing, top_k, down, scale=s2)


def one_row_moe(
    x: torch.Tensor,  # [1, H] the residual stream (not normalised)
    router: torch.Tensor,  # [E, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    top_k: int,
    renormalize: bool,
    norm_weight: torch.Tensor,  # [H] the RMSNorm before the layer
    eps: float,
    config: PairConfig | None = None,
    scales: ExpertScales | None = None,  # e4m3 experts
) -> torch.Tensor:  # [1, H]: x + MoE(rmsnorm(x))
    """A whole MoE layer for one token (batch-1 decode) in three launches, none of them a
    separate norm or add: the router GEMV normalises x on the way, the pair gate/up kernel
    routes and normalises x itself, the pair down kernel adds the residual."""
    x, w13, w2, s13, s2 = _prepare(x, w13, w2, scales)
    assert x.shape[0] == 1 and router.shape == (w13.shape[0], x.shape[1])
    cfg = config or ONE_ROW_CONFIG
    logits = gemv(x, router, norm_weight=norm_weight, eps=eps)  # [1, E]
    gate_up, down = pair_tiles(cfg, x, w13, w2)
    act, routing = pair_gate_up(x, w13, top_k, gate_up, logits=logits,
                                renormalize=renormalize, norm_weight=norm_weight, eps=eps,
                                scale=s13)  # fmt: skip
    return pair_down(act, w2, routing, top_k, down, residual=x, scale=s2)
