"""Mixture-of-experts benchmark (issue 7): `python -m minisgl.benchmark.moe`.

On one CUDA GPU, in one run:

1. the device-to-device copy bandwidth (the floor's denominator);
2. the fused Triton MoE against the torch reference at the Qwen3-30B-A3B layer shape and on
   random shapes, 1..8192 tokens: relative error (both against fp32 math on the same bf16
   inputs), time per call, and the achieved share of the copy bandwidth for the expert weights
   the call touches;
3. decode through the engine with the Qwen3-30B-A3B shape and dummy weights at batch 1, 64 and
   256: tokens/s and the fraction of the floor, where the floor reads, per step, the weights of
   the experts the step actually selected (counted in a separate eager run with the same
   prompts), every other weight once, and each request's KV.

`--tune` runs only a tile sweep per token count: both paths of the fused MoE (pair and
blocked, every block height worth trying), the best whole layer per token count, and that as a
`DEFAULT_CONFIGS` dict to paste into `minisgl/kernels/moe/tiles.py`. `--tune-fp8` runs only the pair
path's sweep with e4m3 experts (a scale per row): the [BLOCK_N, BLOCK_K] kernels' best tiles
(the baseline) and the vec-layout kernels' (`VecTile`), each kernel alone and the layer with
each, and the `FP8_PAIR_TILES` to paste. `--profile` runs only
torch.profiler over a few decode steps (batch 1 by default, CUDA graphs as in serving) and
prints the top GPU kernels by time with their counts per step.
`--w8a8-kernels` runs only a kernel-level A/B of FP8 experts on the blocked path: the
weight-only grouped GEMMs against the W8A8 kernels (`minisgl.kernels.moe.w8a8`);
`--moe-fp8-weight-only` keeps FP8 experts off the W8A8 path (the default since session 17)
for the rest of the run (the decode table).
Prints tables, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from minisgl.benchmark.common import (
    Row,
    add_fp8_args,
    fp8_options,
    gpu_kernel_table,
    measure_bandwidth,
    print_pairs,
    print_table,
    release_memory,
    time_graph,
    trace_events,
)
from minisgl.layers.moe import Routing, SparseMoeBlock, moe_reference, select_experts

if TYPE_CHECKING:
    from minisgl.kernels.fp8 import ExpertScales
    from minisgl.kernels.moe.tiles import FusedMoEConfig, GemmTile, MoEConfig, VecTile

MODEL_DIR = Path(__file__).parent / "models" / "qwen3-30b-a3b"
# Qwen3-30B-A3B's MoE layer.
NUM_EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
DTYPE = torch.bfloat16
KERNEL_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
RANDOM_SHAPE_TOKENS = (1, 37, 512, 8192)
DECODE_BATCHES = (1, 64, 256)
PROMPT_LEN = 256
DECODE_STEPS = 128
COUNT_STEPS = 16
PAGE_SIZE = 16  # of the expert-counting engine
DEVICE = "cuda"


# ---- timing ------------------------------------------------------------------------------------


def time_eager(fn: Callable[[], object], repeats: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


# ---- 2. kernels ----------------------------------------------------------------------------------


@dataclass
class MoEInputs:
    x: torch.Tensor  # [T, H]
    w13: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]
    logits: torch.Tensor  # [T, E] fp32
    top_k: int

    @property
    def routing(self) -> Routing:
        return select_experts(self.logits, self.top_k, renormalize=True)


def random_weights(
    num_experts: int, hidden: int, inter: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=DEVICE, dtype=DTYPE)
    w2 = torch.randn(num_experts, hidden, inter, generator=gen, device=DEVICE, dtype=DTYPE)
    return w13.mul_(hidden**-0.5), w2.mul_(inter**-0.5)


def random_inputs(
    tokens: int, weights: tuple[torch.Tensor, torch.Tensor], top_k: int, seed: int
) -> MoEInputs:
    w13, w2 = weights
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(tokens, w13.shape[2], generator=gen, device=DEVICE, dtype=DTYPE)
    logits = torch.randn(tokens, w13.shape[0], generator=gen, device=DEVICE)
    return MoEInputs(x, w13, w2, logits, top_k)


def routing_sets(inp: MoEInputs, n: int = 4) -> list[torch.Tensor]:
    """`inp.logits` and n - 1 other router logits: timed calls cycle through them, so that at
    small batches they do not find the same few experts' weights in L2 every time."""
    gen = torch.Generator(device=DEVICE).manual_seed(inp.x.shape[0])
    others = [torch.randn(inp.logits.shape, generator=gen, device=DEVICE) for _ in range(n - 1)]
    return [inp.logits, *others]


def rel_err(out: torch.Tensor, truth: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return math.inf
    return ((out.float() - truth).abs().max() / truth.abs().max().clamp_min(1e-30)).item()


def fp32_truth(inp: MoEInputs, routing: Routing) -> torch.Tensor:
    """The reference in fp32 on the same bf16 inputs, one expert stack at a time."""
    return moe_reference(inp.x.float(), inp.w13.float(), inp.w2.float(), routing).float()


def expert_bytes(ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> int:
    """Bytes of the experts that `ids` selects (each read once)."""
    distinct = int(torch.unique(ids).numel())
    per_expert = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    return distinct * per_expert


def mismatched_rows(ids: torch.Tensor, ref_ids: torch.Tensor) -> int:
    """Tokens whose expert sets differ (near-ties may break apart in the two softmaxes)."""
    return int((ids.long().sort(-1).values != ref_ids.sort(-1).values).any(-1).sum())


def run_kernel_case(inp: MoEInputs, copy_bw: float, time_reference: bool) -> Row:
    from minisgl.kernels.moe.layer import fused_experts, fused_moe
    from minisgl.kernels.moe.routing import fused_topk
    from minisgl.kernels.moe.tiles import PairConfig, default_config

    routing = inp.routing
    truth = fp32_truth(inp, routing)
    fused = fused_experts(inp.x, inp.w13, inp.w2, routing.weights, routing.ids)
    # From the logits: on the pair path the routing runs inside the gate/up kernel.
    layer = fused_moe(inp.x, inp.w13, inp.w2, inp.logits, inp.top_k, True)
    cfg = default_config(inp.x.shape[0], inp.top_k, inp.w13.shape[0])
    ref = moe_reference(inp.x, inp.w13, inp.w2, routing)
    _, topk_ids = fused_topk(inp.logits, inp.top_k, True)
    logit_sets = routing_sets(inp)
    seconds = time_graph(
        lambda i: fused_moe(inp.x, inp.w13, inp.w2, logit_sets[i], inp.top_k, True),
        len(logit_sets),
    )
    tokens, hidden = inp.x.shape
    nbytes = expert_bytes(routing.ids, inp.w13, inp.w2) + 2 * inp.x.numel() * inp.x.element_size()
    flops = 2 * tokens * inp.top_k * 3 * hidden * inp.w2.shape[2]
    row: Row = {
        "tokens": tokens,
        "experts": inp.w13.shape[0],
        "top_k": inp.top_k,
        "hidden": hidden,
        "inter": inp.w2.shape[2],
        "path": "pair" if isinstance(cfg, PairConfig) else f"blocked{cfg.block_m}",
        "rel_err": rel_err(fused, truth),
        "moe_rel_err": rel_err(layer, truth),
        "ref_bf16_rel_err": rel_err(ref, truth),
        "topk_mismatch": mismatched_rows(topk_ids, routing.ids),
        "fused_us": seconds * 1e6,
        "bw_fraction": nbytes / seconds / copy_bw,
        "tflops": flops / seconds / 1e12,
    }
    if time_reference:
        row["ref_us"] = time_eager(lambda: moe_reference(inp.x, inp.w13, inp.w2, inp.routing)) * 1e6
    return row


def run_kernels(copy_bw: float, seed: int) -> list[Row]:
    weights = random_weights(NUM_EXPERTS, HIDDEN, INTER, seed)
    rows = [
        run_kernel_case(random_inputs(t, weights, TOP_K, seed + t), copy_bw, time_reference=True)
        for t in KERNEL_TOKENS
    ]
    del weights
    rng = random.Random(seed)
    for _ in range(4):
        experts = rng.randint(8, 160)
        top_k = rng.randint(1, min(8, experts))
        hidden = rng.choice([256, 1000, 1536, 4096])
        inter = rng.choice([96, 200, 512, 1536])
        shape_weights = random_weights(experts, hidden, inter, rng.randrange(1 << 30))
        for t in RANDOM_SHAPE_TOKENS:
            inp = random_inputs(t, shape_weights, top_k, rng.randrange(1 << 30))
            rows.append(run_kernel_case(inp, copy_bw, time_reference=False))
    return rows


# ---- 3. decode through the engine ----------------------------------------------------------------


class ExpertCounter:
    """Counts the distinct experts each MoE layer selects in each decode step (eager runs only:
    forward hooks do not fire inside a replayed CUDA graph)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        self.batch: int | None = None  # record only steps of exactly this many tokens
        self.counts: list[torch.Tensor] = []  # [] int64 per (step, layer), on the device
        self._handles = [block.gate.register_forward_hook(self._hook) for block in self.blocks]
        # A batch-1 step takes `forward_one_row`, whose router is a fused kernel: there the
        # counter runs the router module on the normalised x beside it.
        for block in self.blocks:
            block.forward_one_row = functools.partial(  # type: ignore[method-assign]
                self._one_row, block, block.forward_one_row
            )

    def _one_row(
        self, block: SparseMoeBlock, one_row: Callable[..., torch.Tensor], x: torch.Tensor,
        norm: torch.nn.Module,
    ) -> torch.Tensor:  # fmt: skip
        block.gate(norm(x)[0])  # fires the hook
        return one_row(x, norm)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        for block in self.blocks:
            del block.forward_one_row  # the instance attribute: back to the method

    def _hook(self, module: torch.nn.Module, args: object, logits: torch.Tensor) -> None:
        if self.batch is None or logits.shape[0] != self.batch:
            return
        top_k = self.blocks[0].top_k
        ids = torch.topk(logits, top_k, dim=-1).indices  # softmax keeps the order
        hit = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
        hit[ids.reshape(-1)] = True
        self.counts.append(hit.sum())

    def result(self) -> ExpertCount:
        steps = len(self.counts) / len(self.blocks)
        total = float(torch.stack(self.counts).sum().item())
        return ExpertCount(per_step=total / steps, moe_layers=len(self.blocks))


@dataclass(frozen=True)
class ExpertCount:
    per_step: float  # distinct experts selected in one decode step, summed over the MoE layers
    moe_layers: int


@dataclass(frozen=True)
class ModelBytes:
    per_expert: int  # one expert's three matrices
    dense: int  # every other weight read by a decode step (embedding rows excluded)
    embed_row: int
    kv_per_token: int  # K and V of one token over all layers


def model_bytes(llm: Any) -> ModelBytes:
    model, cfg = llm.engine.model, llm.engine.model_config
    per_expert = dense = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if ".experts." in name:
            per_expert += nbytes // p.shape[0]
        elif "embed_tokens" not in name or cfg.tie_word_embeddings:  # tied: read as lm_head
            dense += nbytes
    moe_layers = sum(isinstance(m, SparseMoeBlock) for m in model.modules())
    elem = torch.empty((), dtype=llm.engine.dtype).element_size()
    kv_elem = llm.engine.pool.k(0).element_size()
    return ModelBytes(
        per_expert=per_expert // max(1, moe_layers),
        dense=dense,
        embed_row=cfg.hidden_size * elem,
        kv_per_token=2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_elem,
    )


def make_llm(
    batch: int, eager: bool, attention_backend: str, cuda_graphs: bool = True, fp8: Row | None = None
) -> Any:  # fmt: skip
    """The engine for the decode runs. The eager one (for counting experts) gets a KV pool just
    big enough, so that little is lost should its memory not come back before the next one.
    `fp8`: the FP8 options (`common.fp8_options`)."""
    from minisgl.llm import LLM

    options: dict[str, Any] = dict(
        load_format="dummy",
        dtype="bfloat16",
        device=DEVICE,
        max_running_requests=batch,
        max_context_len=PROMPT_LEN + DECODE_STEPS + 64,
        attention_backend=attention_backend,
        **(fp8 or {}),
    )
    if not cuda_graphs:
        options["cuda_graph_max_bs"] = 0
    if eager:
        pages = batch * (math.ceil((PROMPT_LEN + COUNT_STEPS + 2) / PAGE_SIZE) + 1)
        options |= dict(cuda_graph_max_bs=0, overlap=False, cache="naive", page_size=PAGE_SIZE,
                        num_pages=pages)  # fmt: skip
    return LLM(str(MODEL_DIR), **options)


def submit(llm: Any, batch: int, max_tokens: int, seed: int) -> list[Any]:
    from minisgl.core import Req, SamplingParams

    rng = random.Random(seed)
    vocab = min(10000, llm.engine.model_config.vocab_size)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reqs = []
    for i in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(PROMPT_LEN)]
        reqs.append(Req(rid=f"moe-{seed}-{i}", prompt_ids=prompt, params=params, seed=i))
    for r in reqs:
        llm.scheduler.add_request(r)
    return reqs


def run_until_decoding(llm: Any, reqs: list[Any]) -> None:
    """Step until every request has its first token (its prefill is done)."""
    while any(not r.output_ids for r in reqs):
        llm.scheduler.step()


def run_to_end(llm: Any) -> int:
    steps = 0
    while llm.scheduler.has_work:
        llm.scheduler.step()
        steps += 1
    return steps


def count_experts(
    batches: Sequence[int], seed: int, attention_backend: str, fp8: Row | None = None
) -> dict[int, ExpertCount]:
    """Distinct experts per decode step (summed over layers), from an eager engine. One token
    selects exactly top_k experts in every MoE layer: batch 1 is not run (with FP8 experts on the
    H200 its eager run recorded no router call, session 17, not yet explained)."""
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    layers = cfg["num_hidden_layers"] - len(cfg.get("mlp_only_layers", []))
    result = {1: ExpertCount(per_step=cfg["num_experts_per_tok"] * layers, moe_layers=layers)}
    batches = [b for b in batches if b != 1]
    if not batches:
        return result
    llm = make_llm(max(batches), eager=True, attention_backend=attention_backend, fp8=fp8)
    counter = ExpertCounter(llm.engine.model)
    for batch in batches:
        reqs = submit(llm, batch, COUNT_STEPS + 1, seed + batch)
        run_until_decoding(llm, reqs)
        counter.batch, counter.counts = batch, []
        run_to_end(llm)
        counter.batch = None
        result[batch] = counter.result()
    counter.close()
    del llm, counter
    release_memory()
    return result


def time_decode(llm: Any, batch: int, seed: int) -> tuple[float, int]:
    """(seconds, decode tokens) of DECODE_STEPS steps of `batch` requests, after a warm-up."""
    run_until_decoding(llm, submit(llm, batch, 9, seed + 1_000_000))  # compile, capture
    run_to_end(llm)
    reqs = submit(llm, batch, DECODE_STEPS + 1, seed + batch)
    run_until_decoding(llm, reqs)
    first = sum(len(r.output_ids) for r in reqs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run_to_end(llm)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return seconds, sum(len(r.output_ids) for r in reqs) - first


def decode_row(
    batch: int, seconds: float, tokens: int, experts: ExpertCount, mb: ModelBytes, copy_bw: float
) -> Row:
    steps = tokens / batch
    mean_context = PROMPT_LEN + (steps + 1) / 2  # tokens of KV each request reads per step
    floor_bytes = (
        experts.per_step * mb.per_expert
        + mb.dense
        + batch * mb.embed_row
        + batch * mean_context * mb.kv_per_token
    )
    step_s = seconds / steps
    floor_s = floor_bytes / copy_bw
    return {
        "batch": batch,
        "prompt_len": PROMPT_LEN,
        "decode_steps": steps,
        "tok_per_s": tokens / seconds,
        "step_ms": step_s * 1e3,
        "experts_per_layer": experts.per_step / experts.moe_layers,
        "floor_gb": floor_bytes / 1e9,
        "floor_ms": floor_s * 1e3,
        "floor_tok_per_s": batch / floor_s,
        "fraction_of_floor": floor_s / step_s,
    }


def run_decode(
    copy_bw: float,
    seed: int,
    attention_backend: str = "auto",
    batches: Sequence[int] = DECODE_BATCHES,
    fp8: Row | None = None,
) -> list[Row]:
    experts = count_experts(batches, seed, attention_backend, fp8)
    llm = make_llm(max(batches), eager=False, attention_backend=attention_backend, fp8=fp8)
    mb = model_bytes(llm)
    rows = []
    for batch in batches:
        seconds, tokens = time_decode(llm, batch, seed)
        rows.append(decode_row(batch, seconds, tokens, experts[batch], mb, copy_bw))
    del llm
    release_memory()
    return rows


# ---- where a decode step's GPU time goes --------------------------------------------------------

PROFILE_STEPS = 8
PROFILE_TOP = 25
# The Triton kernels of minisgl.kernels.moe and .moe_fp8 (the router GEMM is a cuBLAS kernel
# among the rest; the W8A8 path's x quantization, `_act_quant_kernel`, is shared with the FP8
# linear layers and counted with them).
MOE_KERNELS = ("_pair_gate_up_kernel", "_pair_down_kernel", "_pair_gate_up_fp8_kernel",
               "_pair_down_fp8_kernel", "_gate_up_kernel", "_down_kernel", "_topk_kernel",
               "_align_kernel", "_w8a8_gate_up_kernel", "_w8a8_down_kernel")  # fmt: skip


def profile_decode(
    seed: int,
    attention_backend: str,
    batch: int,
    steps: int,
    cuda_graphs: bool,
    trace: str,
    fp8: Row | None = None,
) -> tuple[list[Row], Row]:
    """torch.profiler over `steps` decode steps of `batch` requests: (the kernels by GPU time,
    a summary). A graph replay shows in the profiler's op summaries as one cudaGraphLaunch, so
    the kernels are read from the device events of the exported trace."""
    from torch.profiler import ProfilerActivity, profile

    llm = make_llm(batch, eager=False, attention_backend=attention_backend,
                   cuda_graphs=cuda_graphs, fp8=fp8)  # fmt: skip
    run_until_decoding(llm, submit(llm, batch, 9, seed + 1_000_000))  # compile, capture
    run_to_end(llm)
    run_until_decoding(llm, submit(llm, batch, steps + 8, seed + batch))
    for _ in range(3):  # past the first decode steps
        llm.scheduler.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # no CPU ops: less overhead
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.scheduler.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    run_to_end(llm)
    del llm
    release_memory()
    rows, totals = gpu_kernel_table(trace_events(prof, trace), steps, {"moe_triton": MOE_KERNELS})
    totals |= {"batch": batch, "cuda_graphs": cuda_graphs, "wall_ms_per_step": wall / steps * 1e3}
    return rows[:PROFILE_TOP], totals


# ---- tile sweep ----------------------------------------------------------------------------------

TUNE_TOKENS = (1, 2, 4, 8, 16, 64, 256, 1024, 4096, 8192)
TUNE_BLOCK_M = (16, 32, 64, 128)
# (block_n, block_k, num_warps, num_stages) candidates of the blocked path: narrow tiles for
# memory-bound short blocks, wide ones for compute-bound tall blocks.
TUNE_TILES_SHORT = tuple(itertools.product((16, 32, 64, 128), (128, 256), (4,), (3, 4, 5)))
TUNE_TILES_TALL = tuple(itertools.product((64, 128), (64, 128), (4, 8), (3,))) + (
    (128, 64, 4, 4),
    (64, 64, 4, 4),
)
# The pair path's GEMV tiles (num_stages does nothing there: its loads feed no tl.dot).
TUNE_TILES_PAIR = tuple(itertools.product((8, 16, 32), (256, 512, 1024), (4, 8), (1,)))
PAIR_TUNE_MAX_ROWS = 0.5  # rows per expert up to which the pair path is tried too
TUNE_SETS = 4  # routings each timed call cycles through (see routing_sets)


def tune_block_ms(tokens: int) -> list[int]:
    """Block heights worth trying: up to twice the rows an expert gets on average."""
    rows_per_expert = tokens * TOP_K / NUM_EXPERTS
    limit = max(16, 2 * next_pow2(math.ceil(rows_per_expert)))
    return [m for m in TUNE_BLOCK_M if m <= limit]


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def time_quietly(fn: Callable[[int], object], n_sets: int) -> float | None:
    """Seconds per call, or None when the variant does not compile or fit on this GPU."""
    try:
        return time_graph(fn, n_sets, replays=5)
    except Exception as e:  # noqa: BLE001 (OutOfResources and friends: the tile does not fit)
        print(f"  skip: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
        return None


def best_tile(
    launch: Callable[[Any, int], object],
    candidates: Sequence[tuple[Any, ...]],
    make: Callable[..., Any] | None = None,  # a candidate's tile (default: GemmTile)
) -> tuple[Any, float]:
    """The fastest tile for `launch(tile, set_index)`."""
    from minisgl.kernels.moe.tiles import GemmTile

    best: tuple[Any, float] | None = None
    for candidate in candidates:
        tile = (make or GemmTile)(*candidate)
        seconds = time_quietly(functools.partial(launch, tile), TUNE_SETS)
        if seconds is not None and (best is None or seconds < best[1]):
            best = (tile, seconds)
    if best is None:
        raise RuntimeError("no tile of the sweep runs on this GPU")
    return best


@dataclass
class TuneCase:
    """One token count's inputs: TUNE_SETS routings of the same tokens."""

    inp: MoEInputs
    logit_sets: list[torch.Tensor]
    scales: ExpertScales | None = None  # e4m3 experts (`--tune-fp8`)

    def time_moe(self, config: MoEConfig) -> float | None:
        """The whole layer after the router, as decode runs it."""
        from minisgl.kernels.moe.layer import fused_moe

        inp = self.inp
        return time_quietly(
            lambda i: fused_moe(
                inp.x, inp.w13, inp.w2, self.logit_sets[i], inp.top_k, True, config, self.scales
            ),  # fmt: skip
            len(self.logit_sets),
        )


def tune_pair(case: TuneCase) -> Row:
    """Best gate/up GEMV tile (routing inside), then the best down tile on its output."""
    from minisgl.kernels.moe.pair import pair_down, pair_gate_up
    from minisgl.kernels.moe.tiles import GemmTile, PairConfig

    inp, sets = case.inp, case.logit_sets
    first = GemmTile(16, 256, 4, 1)  # any tile: the down sweep needs activations and routing
    outs = [
        pair_gate_up(inp.x, inp.w13, inp.top_k, first, logits=lg, renormalize=True) for lg in sets
    ]
    gu, gu_s = best_tile(
        lambda t, i: pair_gate_up(inp.x, inp.w13, inp.top_k, t, logits=sets[i], renormalize=True),
        TUNE_TILES_PAIR,
    )
    dn, dn_s = best_tile(
        lambda t, i: pair_down(outs[i][0], inp.w2, outs[i][1], inp.top_k, t), TUNE_TILES_PAIR
    )
    config = PairConfig(gate_up=gu, down=dn)
    return tune_row(case, "pair", None, config, gu_s, dn_s)


# The pair path's e4m3 tiles (`VecTile`): rows a program x (BLOCK_K, warps) with one 16-column
# chunk per thread and step (BLOCK_K = 512 x warps; at H = 2048 gate/up takes 4, 2, 1 steps, or
# half of one at 8 warps; down's TOP_K * I = 6144 takes 12, 6, 3 or 1.5) x the next step's
# loads in flight or not.
TUNE_TILES_PAIR_FP8 = tuple(
    (bn, 512 * warps, warps, "ptx", ahead)
    for bn in (2, 4, 8, 16) for warps in (1, 2, 4, 8) for ahead in (False, True)
)  # fmt: skip


def fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (e4m3 [E, N, K], fp32 [E, N]): a scale per output row, as the engine's
    `--quantization fp8` stores experts."""
    from minisgl.kernels.fp8 import quantize_rows

    q, s = quantize_rows(w.reshape(-1, w.shape[-1]))
    return q.view(w.shape), s.view(w.shape[:-1])


def tune_pair_fp8(case: TuneCase) -> Row:
    """e4m3 experts: the best [BLOCK_N, BLOCK_K] tiles (the kernels the FP8 path ran before the
    vec layout), then the best `VecTile`s, each kernel alone; the layer with each pair."""
    from minisgl.kernels.moe.pair import pair_down, pair_gate_up
    from minisgl.kernels.moe.tiles import PairConfig, VecTile

    inp, sets, scales = case.inp, case.logit_sets, case.scales
    assert scales is not None
    first = VecTile(4, 2048, 4)  # any tile: the down sweeps need activations and routing
    outs = [
        pair_gate_up(inp.x, inp.w13, inp.top_k, first, logits=lg, renormalize=True,
                     scale=scales.w13)
        for lg in sets
    ]  # fmt: skip

    def gate_up(t: GemmTile | VecTile, i: int) -> object:
        return pair_gate_up(inp.x, inp.w13, inp.top_k, t, logits=sets[i], renormalize=True,
                            scale=scales.w13)  # fmt: skip

    def down(t: GemmTile | VecTile, i: int) -> object:
        return pair_down(outs[i][0], inp.w2, outs[i][1], inp.top_k, t, scale=scales.w2)

    gu, gu_s = best_tile(gate_up, TUNE_TILES_PAIR)
    dn, dn_s = best_tile(down, TUNE_TILES_PAIR)
    gu8, gu8_s = best_tile(gate_up, TUNE_TILES_PAIR_FP8, VecTile)
    dn8, dn8_s = best_tile(down, TUNE_TILES_PAIR_FP8, VecTile)
    old = case.time_moe(PairConfig(gu, dn))
    config = PairConfig(gu, dn, gu8, dn8)
    total = case.time_moe(config)
    return {
        "tokens": inp.x.shape[0], "gate_up": tile_str(gu), "gate_up_us": gu_s * 1e6,
        "down": tile_str(dn), "down_us": dn_s * 1e6,
        "old_layer_us": math.inf if old is None else old * 1e6,
        "gate_up_fp8": vec_str(gu8), "gate_up_fp8_us": gu8_s * 1e6,
        "down_fp8": vec_str(dn8), "down_fp8_us": dn8_s * 1e6,
        "layer_us": math.inf if total is None else total * 1e6, "config": config,
    }  # fmt: skip


def vec_str(tile: VecTile) -> str:
    return f"{tile.block_n}x{tile.block_k} w{tile.num_warps}{' ahead' if tile.ahead else ''}"


def tune_fp8(seed: int, token_counts: Sequence[int]) -> list[Row]:
    from minisgl.kernels.fp8 import ExpertScales

    w13, w2 = random_weights(NUM_EXPERTS, HIDDEN, INTER, seed)
    (q13, s13), (q2, s2) = fp8_rows(w13), fp8_rows(w2)
    del w13, w2
    scales = ExpertScales(s13, s2)
    rows = []
    for tokens in token_counts:
        inp = random_inputs(tokens, (q13, q2), TOP_K, seed + tokens)
        rows.append(tune_pair_fp8(TuneCase(inp, routing_sets(inp, TUNE_SETS), scales)))
        print(f"  tune fp8 {rows[-1]}", file=sys.stderr)
    return rows


def tune_blocked(case: TuneCase, block_m: int) -> Row:
    """Best gate/up tile, then the best down tile on its output, for one block height."""
    from minisgl.kernels.moe.blocked import down_gemm, gate_up_gemm
    from minisgl.kernels.moe.routing import fused_topk, moe_align
    from minisgl.kernels.moe.tiles import FusedMoEConfig

    inp = case.inp
    routed = [fused_topk(lg, inp.top_k, True) for lg in case.logit_sets]
    rows = [moe_align(ids, inp.w13.shape[0], block_m) for _, ids in routed]
    candidates = TUNE_TILES_SHORT if block_m <= 32 else TUNE_TILES_TALL
    gu, gu_s = best_tile(
        lambda t, i: gate_up_gemm(inp.x, inp.w13, rows[i], inp.top_k, t), candidates
    )
    acts = [gate_up_gemm(inp.x, inp.w13, r, inp.top_k, gu) for r in rows]
    dn, dn_s = best_tile(
        lambda t, i: down_gemm(acts[i], inp.w2, routed[i][0], rows[i], t), candidates
    )
    return tune_row(case, "blocked", block_m, FusedMoEConfig(block_m, gu, dn), gu_s, dn_s)


def tune_row(
    case: TuneCase, path: str, block_m: int | None, config: MoEConfig, gu_s: float, dn_s: float
) -> Row:
    total = case.time_moe(config)
    return {
        "tokens": case.inp.x.shape[0], "path": path, "block_m": block_m or "",
        "gate_up": tile_str(config.gate_up), "gate_up_us": gu_s * 1e6,
        "down": tile_str(config.down), "down_us": dn_s * 1e6,
        "layer_us": math.inf if total is None else total * 1e6, "config": config,
    }  # fmt: skip


def config_source(config: MoEConfig) -> str:
    from minisgl.kernels.moe.tiles import PairConfig

    def tile(t: GemmTile) -> str:
        return f"GemmTile({t.block_n}, {t.block_k}, {t.num_warps}, {t.num_stages})"

    if isinstance(config, PairConfig):  # the e4m3 tiles: `--tune-fp8`'s, kept apart
        return f"PairConfig({tile(config.gate_up)}, {tile(config.down)}, *FP8_PAIR_TILES)"
    return f"FusedMoEConfig({config.block_m}, {tile(config.gate_up)}, {tile(config.down)})"


def tile_str(tile: GemmTile) -> str:
    return f"{tile.block_n}x{tile.block_k} w{tile.num_warps} s{tile.num_stages}"


def tune(seed: int, token_counts: Sequence[int]) -> list[Row]:
    weights = random_weights(NUM_EXPERTS, HIDDEN, INTER, seed)
    rows = []
    for tokens in token_counts:
        inp = random_inputs(tokens, weights, TOP_K, seed + tokens)
        case = TuneCase(inp, routing_sets(inp, TUNE_SETS))
        if tokens * TOP_K / NUM_EXPERTS <= PAIR_TUNE_MAX_ROWS:
            rows.append(tune_pair(case))
            print(f"  tune {rows[-1]}", file=sys.stderr)
        for block_m in tune_block_ms(tokens):
            rows.append(tune_blocked(case, block_m))
            print(f"  tune {rows[-1]}", file=sys.stderr)
    return rows


def best_per_tokens(rows: list[Row]) -> list[Row]:
    """The fastest whole layer (after the router) for each token count."""
    best: dict[int, Row] = {}
    for r in rows:
        if r["tokens"] not in best or r["layer_us"] < best[r["tokens"]]["layer_us"]:
            best[r["tokens"]] = r
    return [best[t] for t in sorted(best)]


def config_table_source(best: list[Row]) -> str:
    """`DEFAULT_CONFIGS` of minisgl/kernels/moe/tiles.py as Python source, from the sweep's winners:
    each token count's config covers the rows per expert above the previous count's, up to its
    own; the largest count's covers everything above."""
    lines = [
        f"# {NUM_EXPERTS} experts, top-{TOP_K}: rows per expert = tokens * {TOP_K} / {NUM_EXPERTS}",
        "DEFAULT_CONFIGS: dict[float, MoEConfig] = {",
    ]
    for n, r in enumerate(best):
        rows_per_expert = r["tokens"] * TOP_K / NUM_EXPERTS
        bound = "math.inf" if n == len(best) - 1 else f"{rows_per_expert:g}"
        lines.append(f"    {bound}: {config_source(r['config'])},  # {r['tokens']} tokens: "
                     f"{r['layer_us']:.1f} us")  # fmt: skip
    lines.append("}")
    return "\n".join(lines)


# ---- report --------------------------------------------------------------------------------------

KERNEL_COLUMNS = (
    "tokens", "experts", "top_k", "hidden", "inter", "path", "rel_err", "moe_rel_err",
    "ref_bf16_rel_err", "topk_mismatch", "fused_us", "ref_us", "bw_fraction", "tflops",
)  # fmt: skip
DECODE_COLUMNS = (
    "batch", "tok_per_s", "step_ms", "experts_per_layer", "floor_gb", "floor_ms",
    "floor_tok_per_s", "fraction_of_floor",
)  # fmt: skip
TUNE_COLUMNS = (
    "tokens", "path", "block_m", "gate_up", "gate_up_us", "down", "down_us", "layer_us",
)  # fmt: skip
TUNE_FP8_COLUMNS = (
    "tokens", "gate_up", "gate_up_us", "down", "down_us", "old_layer_us", "gate_up_fp8",
    "gate_up_fp8_us", "down_fp8", "down_fp8_us", "layer_us",
)  # fmt: skip
PROFILE_COLUMNS = (
    "kernel",
    "calls",
    "per_step",
    "us_per_step",
    "span_us_per_step",
    "mean_us",
    "share",
)


def summary(result: Row) -> Row:
    out: Row = {}
    if result.get("kernels"):
        # moe_rel_err counts where both routings agree (near-ties may split them apart).
        out["max_rel_err"] = max(
            max(r["rel_err"], r["moe_rel_err"] if r["topk_mismatch"] == 0 else 0.0)
            for r in result["kernels"]
        )
        out["kernel_rel_err_ok"] = out["max_rel_err"] <= 1e-2
    decode = {r["batch"]: r for r in result.get("decode", [])}
    if 1 in decode:
        out["batch1_within_1.5x_of_floor"] = decode[1]["fraction_of_floor"] >= 1 / 1.5
    if 256 in decode:
        out["batch256_at_least_60pct_of_floor"] = decode[256]["fraction_of_floor"] >= 0.6
    return out


# ---- W8A8 vs weight-only FP8 experts, kernel level ------------------------------------------------

W8A8_TOKENS = (64, 128, 256, 512)


def run_w8a8_kernels(seed: int, token_counts: Sequence[int], tune: bool) -> list[Row]:
    """FP8 experts (one scale per row) at the Qwen3-30B-A3B shape: the blocked path's two
    grouped GEMMs with bf16 activations (weight-only, the default) against the W8A8 kernels
    (`minisgl.kernels.moe.w8a8`: the activation quantization, gate/up, down), on the same
    `moe_align` rows, each timed as a CUDA graph; and their error against the bf16 layer on
    the dequantized weights."""
    from minisgl.kernels.fp8 import ExpertScales
    from minisgl.kernels.moe import w8a8
    from minisgl.kernels.moe.tiles import FusedMoEConfig, default_config

    w13, w2 = random_weights(NUM_EXPERTS, HIDDEN, INTER, seed)
    (q13, s13), (q2, s2) = fp8_rows(w13), fp8_rows(w2)
    scales = ExpertScales(s13, s2)
    rows_out: list[Row] = []
    for tokens in token_counts:
        inp = random_inputs(tokens, (w13, w2), TOP_K, seed + tokens)
        cfg = default_config(tokens, TOP_K, NUM_EXPERTS)
        if not isinstance(cfg, FusedMoEConfig) or cfg.block_m > w8a8.MAX_BLOCK_M:
            continue
        row = w8a8_row(inp, cfg, q13, q2, scales, tune)
        print(f"  w8a8 {row}", file=sys.stderr)
        rows_out.append(row)
    return rows_out


def w8a8_row(
    inp: MoEInputs,
    cfg: FusedMoEConfig,
    q13: torch.Tensor,
    q2: torch.Tensor,
    scales: Any,
    tune: bool,
) -> Row:
    """One token count of `run_w8a8_kernels`: each path's gate/up and down launches timed on
    their own (the W8A8 gate/up includes the quantization of x) and together; with `tune`,
    the W8A8 tiles of W8A8_TUNE_* too (gate/up first, then down with the best gate/up)."""
    from minisgl.kernels.fp8.gemm import quantize_activations
    from minisgl.kernels.moe import w8a8
    from minisgl.kernels.moe.blocked import down_gemm, gate_up_gemm
    from minisgl.kernels.moe.routing import fused_topk, moe_align

    tokens = inp.x.shape[0]
    s13, s2 = scales
    sets = routing_sets(inp)
    routed = [fused_topk(lg, TOP_K, True) for lg in sets]
    aligned = [moe_align(ids, NUM_EXPERTS, cfg.block_m) for _, ids in routed]
    w8_m = w8a8.w8a8_block_m(cfg.block_m)  # the W8A8 path's own rows (MIN_BLOCK_M)
    w8_rows = [moe_align(ids, NUM_EXPERTS, w8_m) for _, ids in routed]
    w8 = w8a8.w8a8_config(w8_m)

    def wo_gate_up(i: int) -> torch.Tensor:
        return gate_up_gemm(inp.x, q13, aligned[i], TOP_K, cfg.gate_up, s13)

    acts = [wo_gate_up(i) for i in range(len(sets))]

    def wo_down(i: int) -> torch.Tensor:
        return down_gemm(acts[i], q2, routed[i][0], aligned[i], cfg.down, s2)

    def wo_all(i: int) -> torch.Tensor:
        act = gate_up_gemm(inp.x, q13, aligned[i], TOP_K, cfg.gate_up, s13)
        return down_gemm(act, q2, routed[i][0], aligned[i], cfg.down, s2)

    def w8_gate_up(i: int, tile: Any = w8.gate_up) -> tuple[torch.Tensor, torch.Tensor]:
        xq, xs = quantize_activations(inp.x, w8a8.GROUP)
        return w8a8.w8a8_gate_up(xq, xs, q13, s13, w8_rows[i], TOP_K, tile, inp.x.dtype)

    qacts = [w8_gate_up(i) for i in range(len(sets))]

    def w8_down(i: int, tile: Any = w8.down) -> torch.Tensor:
        aq, a_scale = qacts[i]
        return w8a8.w8a8_down(aq, a_scale, q2, s2, routed[i][0], w8_rows[i], tile, inp.x.dtype)

    def w8_all(i: int, config: Any = w8) -> torch.Tensor:
        return w8a8.w8a8_experts(inp.x, q13, q2, scales, routed[i][0], w8_rows[i], config)

    truth = moe_reference(
        inp.x.float(), q13, q2, Routing(routed[0][0], routed[0][1].long()), scales
    )
    row: Row = {"tokens": tokens, "block_m": cfg.block_m, "w8_block_m": w8_m}
    row["wo_gate_up_us"] = time_graph(wo_gate_up, len(sets)) * 1e6
    row["wo_down_us"] = time_graph(wo_down, len(sets)) * 1e6
    row["w8_gate_up_us"] = time_graph(w8_gate_up, len(sets)) * 1e6
    row["w8_down_us"] = time_graph(w8_down, len(sets)) * 1e6
    row["wo_us"] = time_graph(wo_all, len(sets)) * 1e6
    row["w8_us"] = time_graph(w8_all, len(sets)) * 1e6
    row["speedup"] = row["wo_us"] / row["w8_us"]
    row["wo_err"] = rel_err(wo_down(0).view(tokens, TOP_K, -1).sum(dim=1), truth)
    row["w8_err"] = rel_err(w8_all(0).view(tokens, TOP_K, -1).sum(dim=1), truth)
    row["w8_config"] = str(w8)
    if tune:
        from minisgl.kernels.moe.w8a8 import W8A8Config, W8A8Tile

        best_gu = min(
            (W8A8Tile(*t) for t in W8A8_TUNE_GATE_UP),
            key=lambda t: time_quietly(lambda i: w8_gate_up(i, t), len(sets)) or math.inf,
        )
        best_dn = min(
            (W8A8Tile(*t) for t in W8A8_TUNE_DOWN),
            key=lambda t: time_quietly(lambda i: w8_down(i, t), len(sets)) or math.inf,
        )
        best = W8A8Config(best_gu, best_dn)
        row["tuned_us"] = time_graph(lambda i: w8_all(i, best), len(sets)) * 1e6
        row["tuned_speedup"] = row["wo_us"] / row["tuned_us"]
        row["tuned_config"] = str(best)
    return row


# (block_n, block_k, num_warps, num_stages) of the W8A8 kernels' sweep (`--w8a8-tune`); block_n
# a multiple of 64 (FP8 wgmma's M side per warpgroup); gate/up at 128 quantizes in its epilogue.
W8A8_TUNE_GATE_UP = ((128, 128, 4, 3), (128, 128, 4, 4), (128, 128, 4, 5), (128, 64, 4, 4),
                     (128, 128, 8, 4), (64, 128, 4, 4), (64, 128, 4, 6))  # fmt: skip
W8A8_TUNE_DOWN = ((64, 128, 4, 3), (64, 128, 4, 4), (64, 64, 4, 4), (128, 128, 4, 3),
                  (128, 128, 4, 4), (128, 128, 8, 4))  # fmt: skip
W8A8_COLUMNS = ("tokens", "block_m", "w8_block_m", "wo_gate_up_us", "wo_down_us", "w8_gate_up_us", "w8_down_us",
                "wo_us", "w8_us", "speedup", "wo_err", "w8_err", "tuned_us", "tuned_speedup",
                "tuned_config")  # fmt: skip


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m minisgl.benchmark.moe", description=__doc__)
    ap.add_argument("--skip-kernels", action="store_true", help="no kernel-vs-reference table")
    ap.add_argument("--skip-decode", action="store_true", help="no engine decode table")
    ap.add_argument("--tune", action="store_true", help="only the tile sweep (several minutes)")
    ap.add_argument(
        "--tune-fp8",
        action="store_true",
        help="only the pair path's sweep with e4m3 experts (token counts from --tune-tokens)",
    )
    ap.add_argument(
        "--tune-tokens",
        type=lambda v: [int(t) for t in v.split(",")],
        default=list(TUNE_TOKENS),
        help="token counts of the sweep, comma-separated",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="only torch.profiler over a few decode steps: the top GPU kernels by time",
    )
    ap.add_argument("--profile-batch", type=int, default=1, help="requests of the profiled steps")
    ap.add_argument("--profile-steps", type=int, default=PROFILE_STEPS)
    ap.add_argument("--profile-eager", action="store_true", help="profile without CUDA graphs")
    ap.add_argument("--profile-trace", default="", help="keep the Chrome trace at this path")
    ap.add_argument(
        "--moe-fp8-weight-only",
        action="store_true",
        help="FP8 experts on the blocked path keep the weight-only grouped GEMMs, not the W8A8 "
        "kernels (minisgl.kernels.moe.w8a8; sets MINISGL_MOE_W8A8=0 for this process and its "
        "children)",
    )
    ap.add_argument(
        "--w8a8-block-m",
        type=int,
        default=None,
        help="the W8A8 path's least BLOCK_M (w8a8.MIN_BLOCK_M; sets MINISGL_MOE_W8A8_BLOCK_M)",
    )
    ap.add_argument(
        "--w8a8-kernels",
        action="store_true",
        help="only the kernel-level A/B of FP8 experts: weight-only GEMMs vs the W8A8 kernels",
    )
    ap.add_argument(
        "--w8a8-tune",
        action="store_true",
        help="with --w8a8-kernels: sweep the W8A8 tiles too (W8A8_TUNE_GATE_UP, W8A8_TUNE_DOWN)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention-backend", default="auto", help="of the decode engine")
    ap.add_argument(
        "--decode-batches",
        type=lambda v: [int(t) for t in v.split(",")],
        default=list(DECODE_BATCHES),
        help="batch sizes of the decode table, comma-separated",
    )
    add_fp8_args(ap)
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("moe benchmark: needs a CUDA GPU and none is visible; nothing measured.",
              file=sys.stderr)  # fmt: skip
        return 2
    torch.manual_seed(args.seed)
    copy_bw = measure_bandwidth(torch.device(DEVICE))
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}: copy bandwidth {copy_bw / 1e12:.3f} TB/s")
    result: Row = {"benchmark": "moe", "gpu": gpu, "copy_bw_tb_s": copy_bw / 1e12}
    if args.moe_fp8_weight_only:
        from minisgl.kernels.moe import w8a8

        os.environ[w8a8.ENV_W8A8] = "0"  # engine processes started from here
        w8a8.ENABLED = False
        result["moe_fp8_weight_only"] = True
    if args.w8a8_block_m is not None:
        from minisgl.kernels.moe import w8a8

        os.environ[w8a8.ENV_W8A8_BLOCK_M] = str(args.w8a8_block_m)
        w8a8.MIN_BLOCK_M = args.w8a8_block_m
        result["w8a8_block_m"] = args.w8a8_block_m
    if args.tune_fp8:
        tokens = [t for t in args.tune_tokens if t * TOP_K / NUM_EXPERTS <= PAIR_TUNE_MAX_ROWS]
        result["tune_fp8"] = tune_fp8(args.seed, tokens)
        print_table("pair path, e4m3 experts: [BLOCK_N, BLOCK_K] kernels vs vec layout (VecTile)",
                    result["tune_fp8"], TUNE_FP8_COLUMNS)  # fmt: skip
        for r in result["tune_fp8"]:
            c = r["config"]
            print(f"{r['tokens']} tokens: FP8_PAIR_TILES = ({c.fp8_gate_up!r}, {c.fp8_down!r})")
    elif args.w8a8_kernels:
        result["w8a8"] = run_w8a8_kernels(args.seed, W8A8_TOKENS, args.w8a8_tune)
        print_table("FP8 experts: weight-only vs W8A8 (gate/up + down)", result["w8a8"],
                    W8A8_COLUMNS)  # fmt: skip
    elif args.tune:
        result["tune"] = tune(args.seed, args.tune_tokens)
        result["tune_best"] = best_per_tokens(result["tune"])
        print_table("tile sweep: best per path and block_m", result["tune"], TUNE_COLUMNS)
        print_table("tile sweep: best per token count", result["tune_best"], TUNE_COLUMNS)
        print(
            "\npaste into minisgl/kernels/moe/tiles.py:\n"
            + config_table_source(result["tune_best"])
        )
    elif args.profile:
        kernels, totals = profile_decode(args.seed, args.attention_backend, args.profile_batch,
                                         args.profile_steps, not args.profile_eager,
                                         args.profile_trace, fp8_options(args))  # fmt: skip
        result["profile"], result["profile_totals"] = kernels, totals
        title = f"decode profile: batch {args.profile_batch}, top {PROFILE_TOP} GPU kernels"
        print_table(title, kernels, PROFILE_COLUMNS)
        print_pairs("per decode step", totals)
    else:
        if not args.skip_kernels:
            result["kernels"] = run_kernels(copy_bw, args.seed)
            print_table("fused MoE vs torch reference (bf16)", result["kernels"], KERNEL_COLUMNS)
        if not args.skip_decode:
            result["decode"] = run_decode(copy_bw, args.seed, args.attention_backend,
                                          args.decode_batches, fp8_options(args))  # fmt: skip
            result["fp8"] = fp8_options(args)
            print_table("decode, Qwen3-30B-A3B shape, dummy weights", result["decode"],
                        DECODE_COLUMNS)  # fmt: skip
        result["summary"] = summary(result)
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
