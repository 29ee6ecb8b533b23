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

`--tune` adds a tile sweep of the two grouped GEMMs per token count (for `DEFAULT_CONFIGS`).
Prints tables, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from minisgl.benchmark.common import print_table
from minisgl.layers.moe import Routing, SparseMoeBlock, moe_reference, select_experts

if TYPE_CHECKING:
    from minisgl.kernels.moe import GemmTile

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

Row = dict[str, Any]


# ---- timing ------------------------------------------------------------------------------------


def time_graph(fn: Callable[[], object], replays: int = 10) -> float:
    """Median seconds per call of `fn`, replayed as one CUDA graph of back-to-back calls (the
    way decode runs), after an eager warm-up that also compiles the Triton kernels."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    calls = max(1, min(200, math.ceil(5e-3 / max(start.elapsed_time(end) * 1e-3, 1e-6))))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # capture off the default stream, as torch recommends
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / calls)
    return statistics.median(times)


def time_eager(fn: Callable[[], object], repeats: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def measure_copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes/s of a large device-to-device copy (SM-driven; see `bandwidth.py`)."""
    from minisgl.benchmark.bandwidth import measure_copy_bandwidth as measure

    return measure(nbytes)


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
    from minisgl.kernels.moe import fused_experts, fused_moe, fused_topk

    routing = inp.routing
    truth = fp32_truth(inp, routing)
    fused = fused_experts(inp.x, inp.w13, inp.w2, routing.weights, routing.ids)
    ref = moe_reference(inp.x, inp.w13, inp.w2, routing)
    _, topk_ids = fused_topk(inp.logits, inp.top_k, True)
    seconds = time_graph(lambda: fused_moe(inp.x, inp.w13, inp.w2, inp.logits, inp.top_k, True))
    tokens, hidden = inp.x.shape
    nbytes = expert_bytes(routing.ids, inp.w13, inp.w2) + 2 * inp.x.numel() * inp.x.element_size()
    flops = 2 * tokens * inp.top_k * 3 * hidden * inp.w2.shape[2]
    row: Row = {
        "tokens": tokens,
        "experts": inp.w13.shape[0],
        "top_k": inp.top_k,
        "hidden": hidden,
        "inter": inp.w2.shape[2],
        "rel_err": rel_err(fused, truth),
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

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

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
    return ModelBytes(
        per_expert=per_expert // max(1, moe_layers),
        dense=dense,
        embed_row=cfg.hidden_size * elem,
        kv_per_token=2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem,
    )


def make_llm(batch: int, eager: bool, attention_backend: str) -> Any:
    """The engine for the decode runs. The eager one (for counting experts) gets a KV pool just
    big enough, so that little is lost should its memory not come back before the next one."""
    from minisgl.llm import LLM

    options: dict[str, Any] = dict(
        load_format="dummy",
        dtype="bfloat16",
        device=DEVICE,
        max_running_requests=batch,
        max_context_len=PROMPT_LEN + DECODE_STEPS + 64,
        attention_backend=attention_backend,
    )
    if eager:
        pages = batch * (math.ceil((PROMPT_LEN + COUNT_STEPS + 2) / PAGE_SIZE) + 1)
        options |= dict(cuda_graph_max_bs=0, overlap=False, cache="naive", page_size=PAGE_SIZE,
                        num_pages=pages)  # fmt: skip
    return LLM(str(MODEL_DIR), **options)


def release_memory() -> None:
    """Give a dropped engine's memory back before the next one sizes its KV pool."""
    gc.collect()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated()
    if held > 1 << 30:
        print(f"warning: {held / 2**30:.1f} GiB still allocated after dropping an engine",
              file=sys.stderr)  # fmt: skip


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
    batches: Sequence[int], seed: int, attention_backend: str
) -> dict[int, ExpertCount]:
    """Distinct experts per decode step (summed over layers), from an eager engine."""
    llm = make_llm(max(batches), eager=True, attention_backend=attention_backend)
    counter = ExpertCounter(llm.engine.model)
    result = {}
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


def run_decode(copy_bw: float, seed: int, attention_backend: str = "auto") -> list[Row]:
    experts = count_experts(DECODE_BATCHES, seed, attention_backend)
    llm = make_llm(max(DECODE_BATCHES), eager=False, attention_backend=attention_backend)
    mb = model_bytes(llm)
    rows = []
    for batch in DECODE_BATCHES:
        seconds, tokens = time_decode(llm, batch, seed)
        rows.append(decode_row(batch, seconds, tokens, experts[batch], mb, copy_bw))
    del llm
    release_memory()
    return rows


# ---- tile sweep ----------------------------------------------------------------------------------

TUNE_TOKENS = (1, 8, 64, 256, 1024, 4096, 8192)
TUNE_BLOCK_M = (16, 32, 64, 128)
# (block_n, block_k, num_warps, num_stages) candidates: narrow tiles for memory-bound short
# blocks, wide ones for compute-bound tall blocks.
TUNE_TILES_SHORT = tuple(itertools.product((16, 32, 64), (128, 256), (4,), (3, 4)))
TUNE_TILES_TALL = tuple(itertools.product((64, 128), (64, 128), (4, 8), (3,))) + (
    (128, 64, 4, 4),
    (64, 64, 4, 4),
)


def tune_block_ms(tokens: int) -> list[int]:
    """Block heights worth trying: up to twice the rows an expert gets on average."""
    rows_per_expert = tokens * TOP_K / NUM_EXPERTS
    limit = max(16, 2 * next_pow2(math.ceil(rows_per_expert)))
    return [m for m in TUNE_BLOCK_M if m <= limit]


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def best_tile(launch: Callable[[GemmTile], object], block_m: int) -> tuple[GemmTile, float]:
    """The fastest tile for `launch(tile)`; tiles that do not fit the GPU are skipped."""
    from minisgl.kernels.moe import GemmTile

    best: tuple[GemmTile, float] | None = None
    for bn, bk, warps, stages in TUNE_TILES_SHORT if block_m <= 32 else TUNE_TILES_TALL:
        tile = GemmTile(bn, bk, warps, stages)
        try:
            seconds = time_graph(functools.partial(launch, tile), replays=5)
        except Exception as e:  # noqa: BLE001 (OutOfResources and friends: the tile does not fit)
            print(f"  skip {tile}: {type(e).__name__}", file=sys.stderr)
            continue
        if best is None or seconds < best[1]:
            best = (tile, seconds)
    if best is None:
        raise RuntimeError("no tile of the sweep runs on this GPU")
    return best


def tune_block_m(inp: MoEInputs, block_m: int) -> Row:
    """Best gate/up tile, then the best down tile on its output, for one block height."""
    from minisgl.kernels.moe import down_gemm, fused_topk, gate_up_gemm, moe_align

    topk_weights, ids = fused_topk(inp.logits, inp.top_k, True)
    rows = moe_align(ids, inp.w13.shape[0], block_m)
    gu, gu_s = best_tile(lambda t: gate_up_gemm(inp.x, inp.w13, rows, inp.top_k, t), block_m)
    act = gate_up_gemm(inp.x, inp.w13, rows, inp.top_k, gu)
    dn, dn_s = best_tile(lambda t: down_gemm(act, inp.w2, topk_weights, rows, t), block_m)
    return {
        "tokens": inp.x.shape[0], "block_m": block_m, "gate_up": gu, "gate_up_us": gu_s * 1e6,
        "down": dn, "down_us": dn_s * 1e6, "total_us": (gu_s + dn_s) * 1e6,
    }  # fmt: skip


def tune(seed: int, token_counts: Sequence[int]) -> list[Row]:
    weights = random_weights(NUM_EXPERTS, HIDDEN, INTER, seed)
    rows = []
    for tokens in token_counts:
        inp = random_inputs(tokens, weights, TOP_K, seed + tokens)
        for block_m in tune_block_ms(tokens):
            rows.append(tune_block_m(inp, block_m))
            print(f"  tune {rows[-1]}", file=sys.stderr)
    return rows


def best_per_tokens(rows: list[Row]) -> list[Row]:
    best: dict[int, Row] = {}
    for r in rows:
        if r["tokens"] not in best or r["total_us"] < best[r["tokens"]]["total_us"]:
            best[r["tokens"]] = r
    return [best[t] for t in sorted(best)]


# ---- report --------------------------------------------------------------------------------------

KERNEL_COLUMNS = (
    "tokens", "experts", "top_k", "hidden", "inter", "rel_err", "ref_bf16_rel_err",
    "topk_mismatch", "fused_us", "ref_us", "bw_fraction", "tflops",
)  # fmt: skip
DECODE_COLUMNS = (
    "batch", "tok_per_s", "step_ms", "experts_per_layer", "floor_gb", "floor_ms",
    "floor_tok_per_s", "fraction_of_floor",
)  # fmt: skip
TUNE_COLUMNS = ("tokens", "block_m", "gate_up", "gate_up_us", "down", "down_us", "total_us")


def summary(result: Row) -> Row:
    out: Row = {}
    if result.get("kernels"):
        out["max_rel_err"] = max(r["rel_err"] for r in result["kernels"])
        out["kernel_rel_err_ok"] = out["max_rel_err"] <= 1e-2
    decode = {r["batch"]: r for r in result.get("decode", [])}
    if 1 in decode:
        out["batch1_within_1.5x_of_floor"] = decode[1]["fraction_of_floor"] >= 1 / 1.5
    if 256 in decode:
        out["batch256_at_least_60pct_of_floor"] = decode[256]["fraction_of_floor"] >= 0.6
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m minisgl.benchmark.moe", description=__doc__)
    ap.add_argument("--skip-kernels", action="store_true", help="no kernel-vs-reference table")
    ap.add_argument("--skip-decode", action="store_true", help="no engine decode table")
    ap.add_argument("--tune", action="store_true", help="only the tile sweep (several minutes)")
    ap.add_argument(
        "--tune-tokens",
        type=lambda v: [int(t) for t in v.split(",")],
        default=list(TUNE_TOKENS),
        help="token counts of the sweep, comma-separated",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention-backend", default="auto", help="of the decode engine")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("moe benchmark: needs a CUDA GPU and none is visible; nothing measured.",
              file=sys.stderr)  # fmt: skip
        return 2
    torch.manual_seed(args.seed)
    copy_bw = measure_copy_bandwidth()
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}: copy bandwidth {copy_bw / 1e12:.3f} TB/s")
    result: Row = {"benchmark": "moe", "gpu": gpu, "copy_bw_tb_s": copy_bw / 1e12}
    if args.tune:
        result["tune"] = tune(args.seed, args.tune_tokens)
        result["tune_best"] = best_per_tokens(result["tune"])
        print_table("tile sweep: best per block_m", result["tune"], TUNE_COLUMNS)
        print_table("tile sweep: best per token count", result["tune_best"], TUNE_COLUMNS)
    else:
        if not args.skip_kernels:
            result["kernels"] = run_kernels(copy_bw, args.seed)
            print_table("fused MoE vs torch reference (bf16)", result["kernels"], KERNEL_COLUMNS)
        if not args.skip_decode:
            result["decode"] = run_decode(copy_bw, args.seed, args.attention_backend)
            print_table("decode, Qwen3-30B-A3B shape, dummy weights", result["decode"],
                        DECODE_COLUMNS)  # fmt: skip
        result["summary"] = summary(result)
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
