"""Batch-1 MoE layer on the GPU: `one_row_moe` (router GEMV with the norm, pair gate/up with the
norm, pair down with the residual) against the path it replaces (RMSNorm kernel, cuBLAS router,
`fused_moe`'s pair kernels, residual add), and a sweep of its tiles.

PYTHONPATH=. python3 scripts/moe_one_row_probe.py [--layers 8]

Each timed call is a chain of `--layers` Qwen3-30B-A3B MoE layers (own weights per layer, so
the experts stream from HBM as in decode), x flowing from one layer into the next, replayed as
a CUDA graph; us per layer, and the share of the copy bandwidth for the bytes the layer reads
(router + the 8 selected experts' gate/up and down).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl.benchmark.common import measure_bandwidth, print_table, time_graph
from minisgl.kernels.gemv import GemvConfig, gemv
from minisgl.kernels.moe import (
    ONE_ROW_CONFIG,
    GemmTile,
    PairConfig,
    fused_moe,
    pair_down,
    pair_gate_up,
)

E, TOP_K, H, INTER, EPS = 128, 8, 2048, 768, 1e-6
DT = torch.bfloat16


@dataclass
class Layer:
    router: torch.Tensor  # [E, H]
    w13: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]
    norm: torch.Tensor  # [H]


def make_layers(n: int) -> list[Layer]:
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(DT)

    return [
        Layer(
            rnd(E, H, scale=0.05),
            rnd(E, 2 * INTER, H, scale=H**-0.5),
            rnd(E, H, INTER, scale=INTER**-0.5),
            1 + rnd(H, scale=0.1),
        )  # fmt: skip
        for _ in range(n)
    ]


def one_row_layer(
    x: torch.Tensor, lw: Layer, cfg: PairConfig, router_cfg: GemvConfig | None
) -> torch.Tensor:
    logits = gemv(x, lw.router, norm_weight=lw.norm, eps=EPS, config=router_cfg)
    act, routing = pair_gate_up(x, lw.w13, TOP_K, cfg.gate_up, logits=logits, renormalize=True,
                                norm_weight=lw.norm, eps=EPS)  # fmt: skip
    return pair_down(act, lw.w2, routing, TOP_K, cfg.down, residual=x)


def old_layer(x: torch.Tensor, lw: Layer) -> torch.Tensor:
    h = F.rms_norm(x.float(), (H,), eps=EPS).to(DT) * lw.norm
    return x + fused_moe(h, lw.w13, lw.w2, F.linear(h, lw.router), TOP_K, True)


def chain_us(layers: list[Layer], x0: torch.Tensor, step: Callable[..., torch.Tensor]) -> float:
    def run(_: int) -> torch.Tensor:
        x = x0
        for lw in layers:
            x = step(x, lw)
        return x

    try:
        return time_graph(run, replays=7) / len(layers) * 1e6
    except Exception as e:  # noqa: BLE001 (a tile that does not fit)
        print(f"  skip: {type(e).__name__}: {str(e)[:100]}", file=sys.stderr)
        return float("inf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="no tile sweep: the defaults only")
    args = ap.parse_args()
    layers = make_layers(args.layers)
    x0 = torch.randn(1, H, device="cuda").to(DT)
    bw = measure_bandwidth(torch.device("cuda"))
    layer_bytes = (E * H + TOP_K * 3 * INTER * H) * 2
    floor_us = layer_bytes / bw * 1e6

    # Correctness of the chain against the old path (same routing unless near-ties).
    a = x0
    b = x0
    for lw in layers[:2]:
        a = one_row_layer(a, lw, ONE_ROW_CONFIG, None)
        b = old_layer(b, lw)
    err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
    print(f"one-row vs old path, 2 layers: rel err {err:.2e}")

    rows: list[dict[str, object]] = []

    def add(name: str, us: float) -> None:
        rows.append({"variant": name, "us_per_layer": us, "of_copy_bw": floor_us / us})
        print(f"  {name}: {us:.2f} us", file=sys.stderr)

    add("old: norm + cuBLAS router + pair + add", chain_us(layers, x0, old_layer))
    add(f"one_row default {ONE_ROW_CONFIG}", chain_us(
        layers, x0, lambda x, lw: one_row_layer(x, lw, ONE_ROW_CONFIG, None)))  # fmt: skip
    best_router, best_us = None, float("inf")
    if args.quick:
        print_table("batch-1 MoE layer", rows, ("variant", "us_per_layer", "of_copy_bw"))
        return
    for bn, bk, w in ((1, 2048, 4), (2, 1024, 4), (2, 2048, 8), (4, 512, 4), (4, 1024, 4),
                      (8, 256, 4), (1, 1024, 2)):  # fmt: skip
        rc = GemvConfig(bn, bk, w)
        us = chain_us(layers, x0, lambda x, lw, rc=rc: one_row_layer(x, lw, ONE_ROW_CONFIG, rc))
        add(f"router {bn}x{bk} w{w}", us)
        if us < best_us:
            best_router, best_us = rc, us

    def sweep(
        label: str, tiles: list[GemmTile], config_of: Callable[[GemmTile], PairConfig]
    ) -> GemmTile:
        """The tile of the fastest layer among `config_of(tile)` for each tile."""
        best_tile, best_us = tiles[0], float("inf")
        for t in tiles:
            cfg = config_of(t)
            us = chain_us(layers, x0, lambda x, lw, cfg=cfg: one_row_layer(x, lw, cfg, best_router))
            add(f"{label} {t.block_n}x{t.block_k} w{t.num_warps}", us)
            if us < best_us:
                best_tile, best_us = t, us
        return best_tile

    gate_up_tiles = [GemmTile(bn, bk, w, 1) for bn, bk, w in itertools.product(
        (8, 16, 32), (128, 256, 512), (4, 8))]  # fmt: skip
    down_tiles = [GemmTile(bn, bk, w, 1) for bn, bk, w in itertools.product(
        (4, 8, 16), (256, 512, 1024), (4, 8))]  # fmt: skip
    best_gu = sweep("gate_up", gate_up_tiles, lambda t: PairConfig(t, ONE_ROW_CONFIG.down))
    best_dn = sweep("down", down_tiles, lambda t: PairConfig(best_gu, t))
    best = PairConfig(best_gu, best_dn)
    add(f"best {best} router {best_router}", chain_us(
        layers, x0, lambda x, lw: one_row_layer(x, lw, best, best_router)))  # fmt: skip
    rows.sort(key=lambda r: r["us_per_layer"])  # type: ignore[arg-type, return-value]
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s; a layer reads {layer_bytes / 1e6:.1f} MB: "
          f"floor {floor_us:.2f} us")  # fmt: skip
    shown = rows[:12] + [
        r for r in rows[12:] if str(r["variant"]).startswith(("old", "one_row", "best"))
    ]
    print_table(
        "batch-1 MoE layer, fastest first", shown, ("variant", "us_per_layer", "of_copy_bw")
    )
    print(f"ONE_ROW_CONFIG = {best}\nrouter config = {best_router}")


if __name__ == "__main__":
    main()
