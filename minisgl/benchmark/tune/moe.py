"""Tuners of the MoE kernels on one CUDA GPU at the Qwen3-30B-A3B layer shape (128 experts, top
8; random weights): the pair and blocked paths' tiles per token count (`DEFAULT_CONFIGS` of
`minisgl/kernels/moe/tiles.py`), the pair path's e4m3 tiles (`FP8_PAIR_TILES`) and the W8A8
path's (`W8A8_CONFIGS` of `minisgl/kernels/moe/w8a8.py`). Each kernel is timed as a CUDA graph
cycling through TUNE_SETS routings, so that at small batches the same few experts' weights do
not sit in L2; a tile that does not compile or fit is skipped."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from minisgl.benchmark.common import Row, print_table, time_graph
from minisgl.benchmark.moe import (
    HIDDEN,
    INTER,
    NUM_EXPERTS,
    TOP_K,
    MoEInputs,
    random_inputs,
    random_weights,
    rel_err,
    routing_sets,
)
from minisgl.benchmark.tune import search

TOKENS = (1, 2, 4, 8, 16, 64, 256, 1024, 4096, 8192)
BLOCK_MS = (16, 32, 64, 128)
# (block_n, block_k, num_warps, num_stages) of the blocked path: narrow tiles for memory-bound
# short blocks, wide ones for compute-bound tall blocks.
TILES_SHORT = tuple(itertools.product((16, 32, 64, 128), (128, 256), (4,), (3, 4, 5)))
TILES_TALL = (*itertools.product((64, 128), (64, 128), (4, 8), (3,)), (128, 64, 4, 4),
              (64, 64, 4, 4))  # fmt: skip
# The pair path's GEMV tiles (num_stages does nothing there: its loads feed no tl.dot).
TILES_PAIR = tuple(itertools.product((8, 16, 32), (256, 512, 1024), (4, 8), (1,)))
# Its e4m3 tiles (`VecTile`): rows a program x (BLOCK_K = 512 x warps: one 16-column chunk per
# thread and step) x the next step's loads in flight or not.
TILES_PAIR_FP8 = tuple((bn, 512 * w, w, "ptx", ahead)
                       for bn, w, ahead in itertools.product((2, 4, 8, 16), (1, 2, 4, 8), (False, True)))  # fmt: skip
PAIR_MAX_ROWS = 0.5  # rows per expert up to which the pair path is tried too
TUNE_SETS = 4
W8A8_TOKENS = (64, 128, 256, 512)
# The W8A8 kernels' tiles: block_n a multiple of 64 (FP8 wgmma's M side per warpgroup); gate/up
# at 128 quantizes its output in its epilogue.
W8A8_GATE_UP = ((128, 128, 4, 3), (128, 128, 4, 4), (128, 128, 4, 5), (128, 64, 4, 4),
                (128, 128, 8, 4), (64, 128, 4, 4), (64, 128, 4, 6))  # fmt: skip
W8A8_DOWN = ((64, 128, 4, 3), (64, 128, 4, 4), (64, 64, 4, 4), (128, 128, 4, 3), (128, 128, 4, 4),
             (128, 128, 8, 4))  # fmt: skip
COLUMNS = ("tokens", "path", "block_m", "gate_up", "gate_up_us", "down", "down_us", "layer_us")


def best_tile(
    launch: Callable[[Any, int], object], candidates: Sequence[tuple[Any, ...]], make: Any
) -> tuple[Any, float]:
    """The fastest `make(*candidate)` for `launch(tile, set_index)` (timed cycling through
    TUNE_SETS routings), and its seconds; tiles that do not compile or fit are skipped."""

    def run(tile: Any) -> Row:
        return {
            "tile": tile,
            "s": time_graph(functools.partial(launch, tile), TUNE_SETS, replays=5),
        }

    best = search((make(*c) for c in candidates), run, "s")[0]
    if "error" in best:
        raise RuntimeError(f"no tile of the sweep runs on this GPU: {best['error']}")
    return best["tile"], best["s"]


def fp8_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (e4m3, fp32 [E, N]): a scale per output row, as `--quantization fp8` keeps
    experts."""
    from minisgl.kernels.fp8 import quantize_rows

    q, s = quantize_rows(w.reshape(-1, w.shape[-1]))
    return q.view(w.shape), s.view(w.shape[:-1])


def _layer_us(inp: MoEInputs, sets: list[torch.Tensor], config: Any, scales: Any = None) -> float:
    """The whole layer after the router, as decode runs it (inf when it does not run)."""
    from minisgl.kernels.moe.layer import fused_moe

    def run(_: object) -> Row:
        fn = lambda i: fused_moe(inp.x, inp.w13, inp.w2, sets[i], TOP_K, True, config, scales)  # noqa: E731
        return {"s": time_graph(fn, TUNE_SETS, replays=5)}

    return 1e6 * search([None], run, "s")[0].get("s", math.inf)


Found = tuple[Any, float, Any, float]  # (gate/up tile, its seconds, down tile, its seconds)


def _pair(inp: MoEInputs, sets: list[torch.Tensor], candidates: Sequence[Any], make: Any,
          scales: Any = None) -> Found:  # fmt: skip
    """The best gate/up tile (routing inside), then the best down tile on its output."""
    from minisgl.kernels.moe.pair import pair_down, pair_gate_up

    s13, s2 = scales if scales is not None else (None, None)

    def gate_up(t: Any, i: int) -> Any:
        return pair_gate_up(inp.x, inp.w13, TOP_K, t, logits=sets[i], renormalize=True, scale=s13)

    gu, gu_s = best_tile(gate_up, candidates, make)
    outs = [gate_up(gu, i) for i in range(len(sets))]
    dn, dn_s = best_tile(
        lambda t, i: pair_down(outs[i][0], inp.w2, outs[i][1], TOP_K, t, scale=s2), candidates, make
    )
    return gu, gu_s, dn, dn_s


def _blocked(inp: MoEInputs, sets: list[torch.Tensor], block_m: int) -> Found:
    from minisgl.kernels.moe.blocked import down_gemm, gate_up_gemm
    from minisgl.kernels.moe.routing import fused_topk, moe_align
    from minisgl.kernels.moe.tiles import GemmTile

    routed = [fused_topk(lg, TOP_K, True) for lg in sets]
    rows = [moe_align(ids, NUM_EXPERTS, block_m) for _, ids in routed]
    tiles = TILES_SHORT if block_m <= 32 else TILES_TALL
    gu, gu_s = best_tile(
        lambda t, i: gate_up_gemm(inp.x, inp.w13, rows[i], TOP_K, t), tiles, GemmTile
    )
    acts = [gate_up_gemm(inp.x, inp.w13, r, TOP_K, gu) for r in rows]
    dn, dn_s = best_tile(
        lambda t, i: down_gemm(acts[i], inp.w2, routed[i][0], rows[i], t), tiles, GemmTile
    )
    return gu, gu_s, dn, dn_s


def _row(tokens: int, path: str, block_m: Any, found: Found, layer_us: float, config: Any) -> Row:
    gu, gu_s, dn, dn_s = found
    return {"tokens": tokens, "path": path, "block_m": block_m, "gate_up": gu,
            "gate_up_us": gu_s * 1e6, "down": dn, "down_us": dn_s * 1e6, "layer_us": layer_us,
            "config": config}  # fmt: skip


def tune_moe(seed: int, token_counts: Sequence[int]) -> list[Row]:
    """Per token count: the pair path (up to PAIR_MAX_ROWS rows per expert) and the blocked path
    at each block height up to twice the rows an expert gets; the fastest layer per count
    becomes `DEFAULT_CONFIGS`, each covering the rows per expert above the previous count's."""
    from minisgl.kernels.moe.tiles import FusedMoEConfig, GemmTile, PairConfig

    weights = random_weights(NUM_EXPERTS, HIDDEN, INTER, seed)
    rows = []
    for tokens in token_counts:
        inp = random_inputs(tokens, weights, TOP_K, seed + tokens)
        sets = routing_sets(inp, TUNE_SETS)
        per_expert = tokens * TOP_K / NUM_EXPERTS
        if per_expert <= PAIR_MAX_ROWS:
            found = _pair(inp, sets, TILES_PAIR, GemmTile)
            cfg: Any = PairConfig(found[0], found[2])
            rows.append(_row(tokens, "pair", "", found, _layer_us(inp, sets, cfg), cfg))
        limit = max(16, 2 * (1 << max(0, math.ceil(per_expert) - 1).bit_length()))
        for block_m in (m for m in BLOCK_MS if m <= limit):
            found = _blocked(inp, sets, block_m)
            cfg = FusedMoEConfig(block_m, found[0], found[2])
            rows.append(_row(tokens, "blocked", block_m, found, _layer_us(inp, sets, cfg), cfg))
    best = {r["tokens"]: r for r in sorted(rows, key=lambda r: -r["layer_us"])}
    print_table("tile sweep: best per path and block_m", rows, COLUMNS)
    print(f"\npaste into minisgl/kernels/moe/tiles.py ({NUM_EXPERTS} experts, top {TOP_K}):")
    print("DEFAULT_CONFIGS: dict[float, MoEConfig] = {")
    for n, (tokens, r) in enumerate(sorted(best.items())):
        bound = "math.inf" if n == len(best) - 1 else f"{tokens * TOP_K / NUM_EXPERTS:g}"
        c = r["config"]
        src = (f"PairConfig({c.gate_up!r}, {c.down!r}, *FP8_PAIR_TILES)" if r["path"] == "pair"
               else f"FusedMoEConfig({c.block_m}, {c.gate_up!r}, {c.down!r})")  # fmt: skip
        print(f"    {bound}: {src},  # {tokens} tokens: {r['layer_us']:.1f} us")
    print("}")
    return rows


def tune_moe_fp8(seed: int, token_counts: Sequence[int]) -> list[Row]:
    """e4m3 experts on the pair path: the best `VecTile`s, each kernel alone; the layer with
    them."""
    from minisgl.kernels.fp8 import ExpertScales
    from minisgl.kernels.moe.tiles import PairConfig, VecTile, default_config

    w13, w2 = random_weights(NUM_EXPERTS, HIDDEN, INTER, seed)
    (q13, s13), (q2, s2) = fp8_experts(w13), fp8_experts(w2)
    scales = ExpertScales(s13, s2)
    rows = []
    for tokens in (t for t in token_counts if t * TOP_K / NUM_EXPERTS <= PAIR_MAX_ROWS):
        inp = random_inputs(tokens, (q13, q2), TOP_K, seed + tokens)
        sets = routing_sets(inp, TUNE_SETS)
        vec = _pair(inp, sets, TILES_PAIR_FP8, VecTile, scales)
        tiles = default_config(tokens, TOP_K, NUM_EXPERTS)
        assert isinstance(tiles, PairConfig)
        cfg = PairConfig(tiles.gate_up, tiles.down, vec[0], vec[2])
        rows.append(_row(tokens, "pair vec", "", vec, _layer_us(inp, sets, cfg, scales), cfg))
        print(f"{tokens} tokens: FP8_PAIR_TILES = ({vec[0]!r}, {vec[2]!r})")
    print_table("pair path, e4m3 experts (VecTile)", rows, COLUMNS)
    return rows


def tune_w8a8(seed: int) -> list[Row]:
    """FP8 experts (a scale per row) on the blocked path at W8A8_TOKENS: the W8A8 kernels with
    `W8A8_CONFIGS`' tiles and with the best of W8A8_GATE_UP then W8A8_DOWN (gate/up including
    the quantization of x), on rows `moe_align` sorted; the error of each against the layer on
    the dequantized weights."""
    from minisgl.kernels.fp8 import ExpertScales
    from minisgl.kernels.moe import w8a8
    from minisgl.kernels.moe.tiles import FusedMoEConfig, default_config

    w13, w2 = random_weights(NUM_EXPERTS, HIDDEN, INTER, seed)
    (q13, s13), (q2, s2) = fp8_experts(w13), fp8_experts(w2)
    experts = (q13, q2, ExpertScales(s13, s2))
    rows: list[Row] = []
    for tokens in W8A8_TOKENS:
        cfg = default_config(tokens, TOP_K, NUM_EXPERTS)
        if isinstance(cfg, FusedMoEConfig) and cfg.block_m <= w8a8.MAX_BLOCK_M:
            inp = random_inputs(tokens, (w13, w2), TOP_K, seed + tokens)
            rows.append(_w8a8_row(inp, w8a8.w8a8_block_m(cfg.block_m), experts))
    print_table("FP8 experts on the W8A8 kernels (gate/up + down, us)", rows)
    return rows


def _w8a8_row(inp: MoEInputs, m: int, experts: tuple[torch.Tensor, torch.Tensor, Any]) -> Row:
    from minisgl.kernels.fp8.gemm import quantize_activations
    from minisgl.kernels.moe import w8a8
    from minisgl.kernels.moe.routing import fused_topk, moe_align
    from minisgl.kernels.moe.tiles import GemmTile
    from minisgl.layers.moe import Routing, moe_reference

    q13, q2, scales = experts
    tokens, dtype = inp.x.shape[0], inp.x.dtype
    routed = [fused_topk(lg, TOP_K, True) for lg in routing_sets(inp)]
    sorted_rows = [moe_align(ids, NUM_EXPERTS, m) for _, ids in routed]

    def gate_up(tile: Any, i: int) -> Any:
        xq, xs = quantize_activations(inp.x, w8a8.GROUP)
        return w8a8.w8a8_gate_up(xq, xs, q13, scales.w13, sorted_rows[i], TOP_K, tile, dtype)

    def layer(i: int, config: Any = None) -> torch.Tensor:
        return w8a8.w8a8_experts(inp.x, q13, q2, scales, routed[i][0], sorted_rows[i], config)

    acts = [gate_up(w8a8.w8a8_config(m).gate_up, i) for i in range(len(routed))]
    gu, _ = best_tile(gate_up, W8A8_GATE_UP, GemmTile)

    def down(tile: Any, i: int) -> torch.Tensor:
        aq, a_scale = acts[i]
        return w8a8.w8a8_down(aq, a_scale, q2, scales.w2, routed[i][0], sorted_rows[i], tile, dtype)

    dn, _ = best_tile(down, W8A8_DOWN, GemmTile)
    tuned = w8a8.W8A8Config(gu, dn)
    truth = moe_reference(
        inp.x.float(), q13, q2, Routing(routed[0][0], routed[0][1].long()), scales
    )
    n = len(routed)
    return {"tokens": tokens, "w8_block_m": m, "w8a8_us": 1e6 * time_graph(layer, n),
            "tuned_us": 1e6 * time_graph(lambda i: layer(i, tuned), n),
            "w8a8_err": rel_err(layer(0).view(tokens, TOP_K, -1).sum(1), truth),
            "tuned_err": rel_err(layer(0, tuned).view(tokens, TOP_K, -1).sum(1), truth),
            "tuned": tuned}  # fmt: skip
