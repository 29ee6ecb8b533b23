"""The MoE kernels' tile configurations and the tables that pick them (measured on an H200 at
the Qwen3-30B-A3B shape; `python -m minisgl.benchmark.tune moe` and `moe-fp8` re-measure them)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

# ---- tile configurations -----------------------------------------------------------------------


@dataclass(frozen=True)
class GemmTile:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class FusedMoEConfig:
    """The blocked path: tiles of the two grouped GEMMs; both walk the same BLOCK_M-row expert
    blocks."""

    block_m: int
    gate_up: GemmTile
    down: GemmTile


@dataclass(frozen=True)
class PairConfig:
    """The pair path: GEMV tiles ([BLOCK_N, BLOCK_K] of one expert's weights per loop step) of
    the per-pair gate/up kernel and the per-token down kernel. Their loads feed no tl.dot, so
    Triton does not pipeline them and num_stages has no effect: the kernels prefetch one step
    ahead by hand, and the loads in flight per SM grow with BLOCK_N * BLOCK_K and the number of
    programs (one per pair and BLOCK_N columns of I; one per token and BLOCK_N columns of H)."""

    gate_up: GemmTile
    down: GemmTile
    # e4m3 experts with 16-bit activations: the vec-layout kernels' tiles
    # (`_pair_gate_up_fp8_kernel`, `_pair_down_fp8_kernel`); None: the tiles above, on the
    # kernels that widen a [BLOCK_N, BLOCK_K] tile.
    fp8_gate_up: VecTile | None = None
    fp8_down: VecTile | None = None


@dataclass(frozen=True)
class VecTile:
    """A tile of the pair path's FP8 kernels, in the vec layout of the one-row GEMV
    (`minisgl.kernels.gemv.gemv`, its FP8 section): every thread and warp lies along the reduction;
    each thread owns 16 consecutive columns of each of its rows per step (one 16-byte load of
    e4m3, kept as four int32 words), so BLOCK_K // 16 >= 32 * num_warps on CUDA. BLOCK_N is a
    program's output rows (gate/up: BLOCK_N gate rows and the BLOCK_N matching up rows)."""

    block_n: int
    block_k: int = 2048
    num_warps: int = 4
    # e4m3 -> fp32 by "ptx" (inline PTX, the hardware conversion of each int32's two 16-bit
    # halves; CUDA only: the interpreter runs "cvt" instead) or "cvt" (byte extraction).
    widen: str = "ptx"
    # A step's weights (down: and activations, scales) loaded during the previous step's
    # products: more bytes in flight per program, for twice the registers. At one step (gate/up
    # at H <= BLOCK_K) it only costs registers.
    ahead: bool = True


MoEConfig = FusedMoEConfig | PairConfig

# The pair path's e4m3 tiles (gate/up, down) in DEFAULT_CONFIGS and ONE_ROW_CONFIG: the best of
# `python -m minisgl.benchmark.tune moe-fp8 --tokens 1` on the H200 (Qwen3-30B-A3B shape, one
# token): gate/up 11.3 us, down 5.2 us, the layer 19.2 us against 28.8
# with the best [BLOCK_N, BLOCK_K] tiles of the 16-bit kernels (gate/up 19.4, down 9.4). Gate/up
# 4 columns of I (8 weight rows) a one-warp program, 512 columns a step, the next step's loads
# in flight; down 2 rows a program, TOP_K * I = 6144 columns in 3 steps of 2048.
FP8_PAIR_TILES = (VecTile(4, 512, 1, ahead=True), VecTile(2, 2048, 4, ahead=False))

# Rows per expert (T * K / E) -> config: the first bound (in insertion order, ascending) that is
# >= the call's rows per expert wins; the last bound must be math.inf. At Qwen3-30B-A3B's
# E=128, K=8 one token is 0.0625 rows per expert and 16 tokens are 1. Decode sizes are
# memory-bound (narrow N tiles spread each expert's weights over many SMs); prefill sizes are
# compute-bound (wide tiles reuse each weight tile). Starting points for an H200 at the
# Qwen3-30B-A3B shape; `python -m minisgl.benchmark.tune moe` measures the candidates on the
# GPU at hand and prints a dict in this form to paste here.
DEFAULT_CONFIGS: dict[float, MoEConfig] = {
    # `benchmark.tune moe --tokens 1,2,4,8,16` on an H200, Qwen3-30B-A3B shape (128
    # experts, top 8): 1 token 28.2 us per layer, 2: 48.7, 4: 82.5, 8: 129.1, 16: 199.8.
    # (FP8 tiles: `FP8_PAIR_TILES`, measured at one token.)
    0.0625: PairConfig(GemmTile(16, 256, 4, 1), GemmTile(8, 1024, 8, 1), *FP8_PAIR_TILES),
    0.125: PairConfig(GemmTile(16, 256, 4, 1), GemmTile(16, 1024, 4, 1), *FP8_PAIR_TILES),
    0.25: FusedMoEConfig(16, GemmTile(32, 128, 4, 4), GemmTile(64, 128, 4, 3)),
    0.5: FusedMoEConfig(16, GemmTile(32, 128, 4, 3), GemmTile(64, 128, 4, 4)),
    1: FusedMoEConfig(16, GemmTile(128, 128, 4, 3), GemmTile(64, 128, 4, 3)),
    4: FusedMoEConfig(16, GemmTile(32, 256, 4, 3), GemmTile(64, 128, 4, 4)),
    16: FusedMoEConfig(16, GemmTile(64, 128, 4, 4), GemmTile(64, 128, 4, 4)),
    64: FusedMoEConfig(32, GemmTile(64, 128, 4, 3), GemmTile(128, 64, 4, 3)),
    256: FusedMoEConfig(64, GemmTile(64, 64, 4, 3), GemmTile(128, 64, 4, 3)),
    math.inf: FusedMoEConfig(128, GemmTile(64, 64, 8, 3), GemmTile(128, 64, 8, 3)),
}

# `one_row_moe` (batch-1 decode, the norm and residual inside): any expert count.
# On an H200 at the Qwen3-30B-A3B shape: 31.1 us per layer
# with the router's GEMV (2 x 2048, 8 warps; `minisgl.kernels.gemv.gemv.TUNED`), 37.8 with the tiles
# of the pair path's DEFAULT_CONFIGS entry, 40.3 for the norm + router + pair kernels + add.
ONE_ROW_CONFIG = PairConfig(GemmTile(16, 128, 4, 1), GemmTile(8, 1024, 4, 1), *FP8_PAIR_TILES)


def default_config(
    num_tokens: int, top_k: int, num_experts: int, table: dict[float, MoEConfig] | None = None,
) -> MoEConfig:  # fmt: skip
    rows_per_expert = num_tokens * top_k / num_experts
    configs = DEFAULT_CONFIGS if table is None else table
    return next(cfg for bound, cfg in configs.items() if rows_per_expert <= bound)


def _block_tile(tile: GemmTile, w_scale: int) -> GemmTile:
    """Block-scaled experts take one scale per K step: at most 128 columns deep."""
    if w_scale == 2 and tile.block_k > 128:
        return dataclasses.replace(tile, block_k=128)
    return tile
