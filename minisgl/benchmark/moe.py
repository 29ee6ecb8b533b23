"""Mixture-of-experts benchmark: `python -m minisgl.benchmark.moe`.

On one CUDA GPU, in one run: the copy bandwidth (the floor's denominator); the fused Triton MoE
layer at the Qwen3-30B-A3B layer shape, 1..8192 tokens, against the fp32 torch reference on the
same bf16 inputs (relative error, time per call and the share of the copy bandwidth for the
expert weights the call touches); and decode through the engine with that model's shape and
dummy weights at batch 1, 64 and 256: tokens/s and the fraction of the floor, where the floor
reads, per step, the weights of the experts the step actually selected (counted in a separate
eager run with the same prompts), every other weight once, and each request's KV.

`--profile` runs only torch.profiler over a few decode steps (batch 1 by default, CUDA graphs
as in serving) and prints the top GPU kernels by time with their counts per step. The kernels'
tile sweeps are `python -m minisgl.benchmark.tune moe | moe-fp8 | w8a8`.
"""

from __future__ import annotations

import functools
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minisgl.benchmark import common
from minisgl.benchmark.common import Row
from minisgl.layers.moe import Routing, SparseMoeBlock, moe_reference, select_experts

MODEL_DIR = Path(__file__).parent / "models" / "qwen3-30b-a3b"
# Qwen3-30B-A3B's MoE layer.
NUM_EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
DTYPE = torch.bfloat16
KERNEL_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
DECODE_BATCHES = (1, 64, 256)
PROMPT_LEN = 256
DECODE_STEPS = 128
COUNT_STEPS = 16
PAGE_SIZE = 16  # of the expert-counting engine
DEVICE = "cuda"


# ---- kernels ----------------------------------------------------------------------------------


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


def run_kernel_case(inp: MoEInputs, copy_bw: float) -> Row:
    """The layer from the router's logits (on the pair path the routing runs inside the gate/up
    kernel), timed cycling through `routing_sets`, against the fp32 reference."""
    from minisgl.kernels.moe.layer import fused_moe
    from minisgl.kernels.moe.tiles import PairConfig, default_config

    routing = inp.routing
    layer = fused_moe(inp.x, inp.w13, inp.w2, inp.logits, inp.top_k, True)
    cfg = default_config(inp.x.shape[0], inp.top_k, inp.w13.shape[0])
    sets = routing_sets(inp)
    seconds = common.time_graph(
        lambda i: fused_moe(inp.x, inp.w13, inp.w2, sets[i], inp.top_k, True), len(sets)
    )
    tokens, hidden = inp.x.shape
    nbytes = expert_bytes(routing.ids, inp.w13, inp.w2) + 2 * inp.x.numel() * inp.x.element_size()
    flops = 2 * tokens * inp.top_k * 3 * hidden * inp.w2.shape[2]
    return {
        "tokens": tokens,
        "path": "pair" if isinstance(cfg, PairConfig) else f"blocked{cfg.block_m}",
        "rel_err": rel_err(layer, fp32_truth(inp, routing)),
        "fused_us": seconds * 1e6,
        "bw_fraction": nbytes / seconds / copy_bw,
        "tflops": flops / seconds / 1e12,
    }


def run_kernels(copy_bw: float, seed: int) -> list[Row]:
    weights = random_weights(NUM_EXPERTS, HIDDEN, INTER, seed)
    return [
        run_kernel_case(random_inputs(t, weights, TOP_K, seed + t), copy_bw) for t in KERNEL_TOKENS
    ]


# ---- decode through the engine ----------------------------------------------------------------


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


def make_llm(args: Any, batch: int, eager: bool = False, cuda_graphs: bool = True) -> Any:
    """The engine for the decode runs. The eager one (for counting experts) gets a KV pool just
    big enough, so that little is lost should its memory not come back before the next one."""
    options: Row = dict(max_running_requests=batch, max_context_len=PROMPT_LEN + DECODE_STEPS + 64)
    if not cuda_graphs:
        options["cuda_graph_max_bs"] = 0
    if eager:
        pages = batch * (math.ceil((PROMPT_LEN + COUNT_STEPS + 2) / PAGE_SIZE) + 1)
        options |= dict(cuda_graph_max_bs=0, overlap=False, cache="naive", page_size=PAGE_SIZE,
                        num_pages=pages)  # fmt: skip
    return common.make_llm(args, **options)


def start(llm: Any, batch: int, max_tokens: int, seed: int) -> list[Any]:
    """`batch` requests of PROMPT_LEN random tokens, stepped until each has its first token (its
    prefill done)."""
    from minisgl.core import Req, SamplingParams

    rng = random.Random(seed)
    vocab = min(10000, llm.engine.model_config.vocab_size)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reqs = [Req(f"moe-{seed}-{i}", [rng.randrange(vocab) for _ in range(PROMPT_LEN)], params,
                seed=i) for i in range(batch)]  # fmt: skip
    for r in reqs:
        llm.scheduler.add_request(r)
    while any(not r.output_ids for r in reqs):
        llm.scheduler.step()
    return reqs


def run_to_end(llm: Any) -> None:
    while llm.scheduler.has_work:
        llm.scheduler.step()


def count_experts(args: Any, batches: Sequence[int]) -> dict[int, ExpertCount]:
    """Distinct experts per decode step (summed over layers), from an eager engine. One token
    selects exactly top_k experts in every MoE layer: batch 1 is not run (with FP8 experts on the
    H200 its eager run recorded no router call, not yet explained)."""
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    layers = cfg["num_hidden_layers"] - len(cfg.get("mlp_only_layers", []))
    result = {1: ExpertCount(per_step=cfg["num_experts_per_tok"] * layers, moe_layers=layers)}
    batches = [b for b in batches if b != 1]
    if not batches:
        return result
    seed = args.seed
    llm = make_llm(args, max(batches), eager=True)
    counter = ExpertCounter(llm.engine.model)
    for batch in batches:
        start(llm, batch, COUNT_STEPS + 1, seed + batch)
        counter.batch, counter.counts = batch, []
        run_to_end(llm)
        counter.batch = None
        result[batch] = counter.result()
    counter.close()
    del llm, counter
    common.release_memory()
    return result


def time_decode(llm: Any, batch: int, seed: int) -> tuple[float, int]:
    """(seconds, decode tokens) of DECODE_STEPS steps of `batch` requests, after a warm-up."""
    start(llm, batch, 9, seed + 1_000_000)  # compile, capture
    run_to_end(llm)
    reqs = start(llm, batch, DECODE_STEPS + 1, seed + batch)
    first = sum(len(r.output_ids) for r in reqs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run_to_end(llm)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return seconds, sum(len(r.output_ids) for r in reqs) - first


def decode_row(batch: int, seconds: float, tokens: int, experts: ExpertCount,
               mb: common.ModelBytes, embed_row: int, copy_bw: float) -> Row:  # fmt: skip
    """The floor reads the experts the step selected, every other weight once, the embedding
    rows of its tokens and each request's KV at its mean context."""
    steps = tokens / batch
    mean_context = PROMPT_LEN + (steps + 1) / 2  # tokens of KV each request reads per step
    per_expert = mb.experts / (experts.moe_layers * mb.num_experts)
    floor_bytes = (experts.per_step * per_expert + mb.weights - mb.experts + batch * embed_row
                   + batch * mean_context * mb.kv_per_token)  # fmt: skip
    step_s, floor_s = seconds / steps, floor_bytes / copy_bw
    return {"batch": batch, "prompt_len": PROMPT_LEN, "decode_steps": steps,
            "tok_per_s": tokens / seconds, "step_ms": step_s * 1e3,
            "experts_per_layer": experts.per_step / experts.moe_layers,
            "floor_gb": floor_bytes / 1e9, "floor_ms": floor_s * 1e3,
            "floor_tok_per_s": batch / floor_s, "fraction_of_floor": floor_s / step_s}  # fmt: skip


def run_decode(args: Any, copy_bw: float) -> list[Row]:
    batches = args.decode_batches
    experts = count_experts(args, batches)
    llm = make_llm(args, max(batches))
    engine = llm.engine
    mb = common.ModelBytes.of(engine.model, engine.model_config, engine.pool.dtype)
    embed_row = engine.model_config.hidden_size * torch.empty((), dtype=engine.dtype).element_size()
    rows = []
    for batch in batches:
        seconds, tokens = time_decode(llm, batch, args.seed)
        rows.append(decode_row(batch, seconds, tokens, experts[batch], mb, embed_row, copy_bw))
    del llm
    common.release_memory()
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


def profile_decode(args: Any) -> tuple[list[Row], Row]:
    """torch.profiler over `--profile-steps` decode steps of `--profile-batch` requests: the
    kernels by GPU time (read from the trace's device events: a graph replay shows in the
    profiler's op summaries as one cudaGraphLaunch) and a summary."""
    batch, steps, cuda_graphs = args.profile_batch, args.profile_steps, not args.profile_eager
    llm = make_llm(args, batch, cuda_graphs=cuda_graphs)
    start(llm, batch, 9, args.seed + 1_000_000)  # compile, capture
    run_to_end(llm)
    start(llm, batch, steps + 8, args.seed + batch)
    for _ in range(3):  # past the first decode steps
        llm.scheduler.step()
    label = f"decode profile, batch {batch}: "
    rows, totals = common.profile_steps(llm.scheduler.step, steps, label, args.profile_trace,
                                 {"moe_triton": MOE_KERNELS}, PROFILE_TOP)  # fmt: skip
    run_to_end(llm)
    del llm
    common.release_memory()
    return rows, totals | {"batch": batch, "cuda_graphs": cuda_graphs}


# ---- report --------------------------------------------------------------------------------------


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


def main(argv: Sequence[str] | None = None) -> int:
    ints = lambda v: [int(t) for t in v.split(",")]  # noqa: E731
    p = common.engine_parser(__doc__, MODEL_DIR, load_format="dummy", dtype="bfloat16")
    p.add_argument("--skip-kernels", action="store_true", help="no kernel-vs-reference table")
    p.add_argument("--skip-decode", action="store_true", help="no engine decode table")
    p.add_argument("--decode-batches", type=ints, default=list(DECODE_BATCHES),
                   help="batch sizes of the decode table, comma-separated")  # fmt: skip
    p.add_argument("--profile", action="store_true",
                   help="only torch.profiler over a few decode steps: the top GPU kernels by time")  # fmt: skip
    p.add_argument("--profile-batch", type=int, default=1, help="requests of the profiled steps")
    p.add_argument("--profile-steps", type=int, default=PROFILE_STEPS)
    p.add_argument("--profile-eager", action="store_true", help="profile without CUDA graphs")
    p.add_argument("--profile-trace", default="", help="keep the Chrome trace at this path")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe benchmark: needs a CUDA GPU and none is visible; nothing measured.",
              file=sys.stderr)  # fmt: skip
        return 2
    torch.manual_seed(args.seed)
    copy_bw = common.measure_bandwidth(torch.device(DEVICE))
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}: copy bandwidth {copy_bw / 1e12:.3f} TB/s")
    result: Row = {"benchmark": "moe", "gpu": gpu, "copy_bw_tb_s": copy_bw / 1e12}
    if args.profile:
        result["profile"], result["profile_totals"] = profile_decode(args)
        common.print_pairs("per decode step", result["profile_totals"])
    else:
        if not args.skip_kernels:
            result["kernels"] = run_kernels(copy_bw, args.seed)
            common.print_table("fused MoE vs the fp32 torch reference (bf16)", result["kernels"])
        if not args.skip_decode:
            result["decode"] = run_decode(args, copy_bw)
            result["fp8"] = {k: getattr(args, k) for k in ("kv_cache_dtype", "quantization")}
            common.print_table("decode, Qwen3-30B-A3B shape, dummy weights", result["decode"])
        result["summary"] = summary(result)
    common.emit_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
