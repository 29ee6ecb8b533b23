"""Mixture-of-experts benchmark: `python -m minisgl.benchmark.moe`.

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

`--profile` runs only torch.profiler over a few decode steps (batch 1 by default, CUDA graphs
as in serving) and prints the top GPU kernels by time with their counts per step.
`--moe-fp8-weight-only` keeps FP8 experts off the W8A8 path (`minisgl.kernels.moe.w8a8`, on by
default) for the run. The kernels' tile sweeps are `python -m minisgl.benchmark.tune moe |
moe-fp8 | w8a8`. Prints tables, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from minisgl.config import env
from minisgl.layers.moe import Routing, SparseMoeBlock, moe_reference, select_experts

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
    H200 its eager run recorded no router call, not yet explained)."""
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
# The Triton kernels of minisgl.kernels.moe (the router GEMM is a cuBLAS kernel
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


# ---- report --------------------------------------------------------------------------------------

KERNEL_COLUMNS = (
    "tokens", "experts", "top_k", "hidden", "inter", "path", "rel_err", "moe_rel_err",
    "ref_bf16_rel_err", "topk_mismatch", "fused_us", "ref_us", "bw_fraction", "tflops",
)  # fmt: skip
DECODE_COLUMNS = (
    "batch", "tok_per_s", "step_ms", "experts_per_layer", "floor_gb", "floor_ms",
    "floor_tok_per_s", "fraction_of_floor",
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


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m minisgl.benchmark.moe", description=__doc__)
    ap.add_argument("--skip-kernels", action="store_true", help="no kernel-vs-reference table")
    ap.add_argument("--skip-decode", action="store_true", help="no engine decode table")
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
        help="the W8A8 path's least BLOCK_M (sets MINISGL_MOE_W8A8_BLOCK_M)",
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
        os.environ[env.MOE_W8A8.name] = "0"  # read at use, here and in engine processes
        result["moe_fp8_weight_only"] = True
    if args.w8a8_block_m is not None:
        os.environ[env.MOE_W8A8_BLOCK_M.name] = str(args.w8a8_block_m)
        result["w8a8_block_m"] = args.w8a8_block_m
    if args.profile:
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
