"""Fused mixture-of-experts for CUDA (imports Triton).

Two paths, both without a host sync (CUDA-graph safe); the config table picks one by the rows
each expert gets on average (T * K / E):

Pair path, for a few tokens (decode at small batch), where the step is launch- and
latency-bound; two launches after the router GEMM:

1. `_pair_gate_up_kernel`: one program per (token, k) pair and BLOCK_N columns of I. It routes
   the token itself (softmax over the router logits, top-k, renormalise: the same math as
   `fused_topk`), multiplies the token's row by its expert's gate and up slices (a GEMV) and
   writes silu(gate) * up. No sort: each pair reads its own expert's weights (two pairs of
   different tokens on one expert read it twice, hence "a few tokens").
2. `_pair_down_kernel`: one program per token and BLOCK_N columns of H; it loops over the
   token's k experts and sums routing weight * down projection, writing the layer's output.

`one_row_moe` is the pair path for one token with the layer's surroundings folded in (batch-1
decode): the router as a one-row GEMV with the RMSNorm in its prologue, the gate/up kernel
normalising x itself, the down kernel adding the residual.

With e4m3 experts and 16-bit activations the pair path runs two kernels of the same contract in
the one-row FP8 GEMV's vec layout (`pair.py`, `PairConfig.fp8_gate_up`, `fp8_down`).

Blocked path, for everything larger; five launches:

1. `fused_topk`: softmax over the router logits, the top k experts of each token, renormalised.
2. `moe_align`: the T*K (token, expert) pairs sorted by expert, each expert's run padded to a
   multiple of BLOCK_M, so every block of BLOCK_M rows belongs to one expert.
3. gate/up grouped GEMM: each program multiplies one block of gathered token rows by a
   BLOCK_N-column slice of its expert's gate and up weights and writes silu(gate) * up.
4. down grouped GEMM: the activations by the expert's down weights, times the routing weight,
   written to the row of each (token, k) pair.
5. a sum over the k rows of each token.

With e4m3 experts at decode sizes steps 3 and 4 run on FP8 activations too (`w8a8.py`). The
math is `minisgl.layers.moe.moe_reference`; `routing.align_reference` specifies step 2.
"""

from __future__ import annotations

import torch

from minisgl.kernels.fp8 import ExpertScales
from minisgl.kernels.gemv.gemv import gemv
from minisgl.kernels.moe import w8a8
from minisgl.kernels.moe.blocked import down_gemm, gate_up_gemm
from minisgl.kernels.moe.pair import PairRouting, pair_down, pair_gate_up, pair_tiles
from minisgl.kernels.moe.routing import fused_topk, moe_align
from minisgl.kernels.moe.tiles import (
    ONE_ROW_CONFIG,
    MoEConfig,
    PairConfig,
    default_config,
)

# ---- the whole layer ---------------------------------------------------------------------------


def _check_shapes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    if w13.shape[2] != x.shape[1] or w2.shape[1] != x.shape[1] or w13.shape[1] != 2 * w2.shape[2]:
        raise ValueError(
            f"expert shapes {tuple(w13.shape)}, {tuple(w2.shape)} do not fit x {tuple(x.shape)}"
        )


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
    _check_shapes(x, w13, w2)
    if num_tokens == 0:
        return torch.zeros_like(x)
    cfg = config or default_config(num_tokens, top_k, w13.shape[0])
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    s13, s2 = scales if scales is not None else (None, None)
    ids = topk_ids.to(torch.int32).contiguous()
    weights = topk_weights.float().contiguous()
    if isinstance(cfg, PairConfig):
        routing = PairRouting(ids.view(-1), weights.view(-1))
        gate_up, down = pair_tiles(cfg, x, w13, w2)
        act, _ = pair_gate_up(x, w13, top_k, gate_up, routing=routing, scale=s13)
        return pair_down(act, w2, routing, top_k, down, scale=s2)
    if s13 is not None and s2 is not None and w8a8.use_w8a8(x, w13, cfg.block_m):
        # e4m3 activations too, on FP8 wgmma (`minisgl.kernels.moe.w8a8`; MINISGL_MOE_W8A8=0: off)
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
    _check_shapes(x, w13, w2)
    if num_tokens == 0:
        return torch.zeros_like(x)
    cfg = config or default_config(num_tokens, top_k, w13.shape[0])
    if isinstance(cfg, PairConfig):
        x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
        s13, s2 = scales if scales is not None else (None, None)
        gate_up, down = pair_tiles(cfg, x, w13, w2)
        act, routing = pair_gate_up(x, w13, top_k, gate_up, logits=router_logits,
                                    renormalize=renormalize, scale=s13)  # fmt: skip
        return pair_down(act, w2, routing, top_k, down, scale=s2)
    weights, ids = fused_topk(router_logits, top_k, renormalize)
    return fused_experts(x, w13, w2, weights, ids, cfg, scales)


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
    separate norm or add: the router as a one-row GEMV that normalises x on the way
    (`minisgl.kernels.gemv.gemv`); the pair gate/up kernel, which routes and normalises x itself;
    the pair down kernel, which adds the residual."""
    _check_shapes(x, w13, w2)
    assert x.shape[0] == 1 and router.shape == (w13.shape[0], x.shape[1])
    cfg = config or ONE_ROW_CONFIG
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    s13, s2 = scales if scales is not None else (None, None)
    logits = gemv(x, router, norm_weight=norm_weight, eps=eps)  # [1, E]
    gate_up, down = pair_tiles(cfg, x, w13, w2)
    act, routing = pair_gate_up(x, w13, top_k, gate_up, logits=logits,
                                renormalize=renormalize, norm_weight=norm_weight, eps=eps,
                                scale=s13)  # fmt: skip
    return pair_down(act, w2, routing, top_k, down, residual=x, scale=s2)
