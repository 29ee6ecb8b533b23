"""What FP8 costs in accuracy (W7): `python -m minisgl.benchmark.accuracy --model PATH.gguf`.

The built-in text (`minisgl.engine.calibration_text`, 2,738 tokens for SmolLM2) is scored in one
prefill by the same model in several forms: the baseline (fp32 on a CPU, bf16 on a GPU), an FP8
KV cache (scales 1.0, and calibrated on 2,048 tokens of the same text), FP8 weights (every
decoder projection and expert quantized at load, one scale per output channel), and both. For
each: the perplexity of the text, the mean KL divergence KL(baseline || variant) of the
next-token distributions over all positions, its largest value, and how often the two agree on
the most likely next token.

The scoring runs the engine's model with its attention backend over a pool of its own (the
engine's KV dtype and scales), so the K/V of every position are stored and read back exactly as
serving stores them. With `--quantization fp8` the prefill's activations are rounded to e4m3 per
token as the FP8 tensor-core GEMMs round them (a prefill has more rows than the weight-only
switch). Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import torch

from minisgl.attention import AttentionInputs, make_backend
from minisgl.benchmark import common
from minisgl.benchmark.common import Row
from minisgl.core import TableWrite
from minisgl.engine.kv_calibration import text_ids
from minisgl.kvcache import KVPool, ReqTable
from minisgl.layers import ForwardContext
from minisgl.llm import LLM
from minisgl.weights import resolve_source

# (name, engine options)
VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("baseline", {}),
    ("fp8 KV (scales 1.0)", {"kv_cache_dtype": "fp8_e4m3"}),
    ("fp8 KV (calibrated)", {"kv_cache_dtype": "fp8_e4m3", "kv_cache_calibrate": 2048}),
    ("fp8 weights", {"quantization": "fp8"}),
    # As decode steps of up to FP8_GEMV_MAX_ROWS rows run: activations not rounded.
    ("fp8 weights (weight-only)", {"quantization": "fp8", "fp8_gemv_max_rows": 1 << 30}),
    ("fp8 weights + KV", {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3",
                          "kv_cache_calibrate": 2048}),
]  # fmt: skip
LOGIT_CHUNK = 512  # positions whose full-vocabulary distributions are held at once


@torch.inference_mode()
def text_log_probs(llm: LLM, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] fp32 log-probabilities of the next token at every position of `ids`,
    one prefill through the engine's model and attention backend (a pool of its own, with the
    engine's KV dtype and scales), on the host."""
    engine = llm.engine
    n, device = len(ids), engine.device
    pool = KVPool(
        engine.pool.num_layers, n, 1, engine.pool.num_kv_heads, engine.pool.head_dim,
        engine.pool.dtype, device,
    )  # fmt: skip
    pool.all_scales().copy_(engine.pool.all_scales())
    pool.set_k_shift(engine.pool.all_k_shifts())
    table = ReqTable(1, n, 1, device)
    table.apply([TableWrite(slot=0, start=0, values=list(range(n)))], [])
    mcfg = engine.model_config
    backend = make_backend(
        engine.config.attention_backend, pool, table, engine.backend.num_q_heads,
        mcfg.head_dim**-0.5,
    )  # fmt: skip
    inputs = AttentionInputs.fresh_prefill(n, device)
    ctx = ForwardContext(backend, backend.prepare(inputs))
    ids_t = torch.tensor(ids, dtype=torch.int64, device=device)
    hidden = engine.model(ids_t, torch.arange(n, device=device), ctx)  # [n, hidden]
    logits = engine.model.compute_logits  # [rows, hidden] -> [rows, vocab]
    chunks = [
        logits(hidden[i : i + LOGIT_CHUNK]).float().log_softmax(-1).cpu()  # type: ignore[operator]
        for i in range(0, n, LOGIT_CHUNK)
    ]
    return torch.cat(chunks)


def compare(base: torch.Tensor, lp: torch.Tensor, ids: list[int]) -> Row:
    """Perplexity of `ids` under `lp` and its divergence from `base` ([n, vocab] log-probs)."""
    targets = torch.tensor(ids[1:])
    nll = -lp[:-1].gather(1, targets[:, None]).squeeze(1)  # [n - 1]
    kl = (base.exp() * (base - lp)).sum(-1)  # [n]
    return {
        "perplexity": math.exp(nll.mean().item()),
        "mean_kl": kl.mean().item(),
        "max_kl": kl.max().item(),
        "top1_agreement": (base.argmax(-1) == lp.argmax(-1)).float().mean().item(),
    }


def run(args: Any) -> Row:
    src = resolve_source(args.model)
    rows: list[Row] = []
    base: torch.Tensor | None = None
    ids: list[int] = []
    for name, options in VARIANTS:
        if name not in args.variants:
            continue
        llm = common.make_llm(args, num_pages=64, skip_warmup=True, cuda_graph_max_bs=0, **options)
        if not ids:
            ids = text_ids(src, llm.engine.model_config.vocab_size)[: args.tokens]
        lp = text_log_probs(llm, ids)
        dtype = llm.engine.config.dtype
        del llm
        common.release_memory()
        if base is None:
            base = lp
        row = {"variant": name, "dtype": dtype, "tokens": len(ids), **compare(base, lp, ids)}
        row["perplexity_vs_baseline"] = row["perplexity"] / rows[0]["perplexity"] if rows else 1.0
        rows.append(row)
        print(f"  {name}: {row}", file=sys.stderr, flush=True)
    return {"rows": rows}


def main(argv: Sequence[str] | None = None) -> None:
    p = common.engine_parser(__doc__)
    p.add_argument("--tokens", type=int, default=None, help="score only the text's first N tokens")
    names = [name for name, _ in VARIANTS]
    p.add_argument("--variants", type=lambda v: v.split(","), default=names,
                   help="comma-separated subset of: " + ", ".join(names))  # fmt: skip
    args = p.parse_args(argv)
    device = common.resolve_device(args.device)
    if args.dtype == "auto":  # the baseline: fp32 on a CPU, bf16 on a GPU
        args.dtype = "bfloat16" if device.type == "cuda" else "float32"
    if args.variants[0] != "baseline":
        args.variants = ["baseline", *args.variants]
    src = resolve_source(args.model)
    info = {"workload": "W7 accuracy", "model": src.name, **common.device_info(device)}
    print(f"FP8 accuracy: {src.name} on {info['device']}, {args.dtype}, the built-in text")
    result = run(args)
    common.print_table("perplexity and KL(baseline || variant) of the next-token distributions",
                result["rows"])  # fmt: skip
    common.emit_json({**info, **result})


if __name__ == "__main__":
    main()
