"""The MoE kernels' tile configurations and the tables that pick them (measured on an H200 at
the Qwen3-30B-A3B shape; `python -m minisgl.benchmark.tune moe` and `moe-fp8` re-measure them)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


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
    """The pair path: GEMV tiles ([BLOCK_N, BLOCK_K] of one expert's weights a step) of the
    per-pair gate/up kernel and the per-token down kernel. Their loads feed no tl.dot, so
    num_stages has no effect: the kernels prefetch one step ahead by hand."""

    gate_up: GemmTile
    down: GemmTile
    # e4m3 experts with 16-bit activations: the vec-layout kernels' tiles; None: the tiles
    # above, on the kernels that widen a [BLOCK_N, BLOCK_K] tile.
    fp8_gate_up: VecTile | None = None
    fp8_down: VecTile | None = None


@dataclass(frozen=True)
class VecTile:
    """A tile of the pair path's FP8 kernels, in the one-row GEMV's vec layout: threads and
    warps along the reduction, 16 columns of each row a thread and step (BLOCK_K // 16 >= 32 *
    num_warps on CUDA). BLOCK_N: a program's output rows (gate/up: as many gate and up rows)."""

    block_n: int
    block_k: int = 2048
    num_warps: int = 4
    widen: str = "ptx"  # `GemvConfig.widen` (the interpreter runs "cvt")
    # A step's loads issued during the previous step's products: more bytes in flight, twice
    # the registers.
    ahead: bool = True


MoEConfig = FusedMoEConfig | PairConfig

# The pair path's e4m3 tiles (gate/up, down): the best of `python -m minisgl.benchmark.tune
# moe-fp8 --tokens 1` on the H200 (Qwen3-30B-A3B shape): gate/up 11.3 us, down 5.2 us, the
# layer 19.2 us against 28.8 with the best tiles of the 16-bit kernels.
FP8_PAIR_TILES = (VecTile(4, 512, 1, ahead=True), VecTile(2, 2048, 4, ahead=False))

# Rows per expert (T * K / E) -> config: the first bound (ascending; the last is math.inf) at
# or above the call's rows per expert wins (Qwen3-30B-A3B: one token is 0.0625, 16 tokens 1).
# Decode sizes are memory-bound (narrow tiles spread an expert over many SMs), prefill sizes
# compute-bound (wide tiles reuse each weight tile). `python -m minisgl.benchmark.tune moe`
# prints this table for the GPU at hand (H200, Qwen3-30B-A3B: 28.2 us a layer at one token).
DEFAULT_CONFIGS: dict[float, MoEConfig] = {
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

# `one_row_moe` (batch-1 decode, the norm and residual inside); H200, Qwen3-30B-A3B: 31.1 us a
# layer with the router's GEMV, 40.3 for the norm + router + pair kernels + add.
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
