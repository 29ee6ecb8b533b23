"""W1, offline throughput (BENCHMARKS.md): `python -m minisgl.benchmark.offline`.

256 requests drawn exactly as nano-vllm's bench draws them (`random.seed(0)`; prompt lengths
and token ids first, then the output lengths), temperature 0.6, `ignore_eos`; dummy weights of
the Qwen3-0.6B shape by default. After a warm-up, the whole `LLM.generate` call is timed against
the floor at the copy bandwidth measured in the same run, each tensor counted in the dtype it is
stored in (`--kv-cache-dtype fp8_e4m3`, `--quantization fp8`). A per-step table (decode steps by
batch size against their own floor) shows where the time goes. `--engine hf` runs the first
`--hf-requests` requests through minisgl, then through transformers' continuous batching in the
same process, and prints the ratio of output tokens/s.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from minisgl.benchmark import common
from minisgl.benchmark.common import Row, Workload
from minisgl.core import Batch, SamplingParams
from minisgl.llm import LLM

TokenIdLLM = common.TokenIdLLM  # scripts/gpu_profile.py takes it from here

DEFAULT_MODEL = Path(__file__).parent / "models" / "qwen3-0.6b"
W1_INPUT_TOKENS, W1_OUTPUT_TOKENS = 142_827, 133_966
TEMPERATURE = 0.6


def w1_workload(num_requests: int = 256, length_scale: float = 1.0, vocab: int = 10001) -> Workload:
    """W1; `length_scale` < 1 and a small `vocab` shrink it for smoke tests on tiny models."""
    rng = random.Random(0)  # the same sequence as `random.seed(0)`
    prompts = [
        [rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(num_requests)
    ]
    max_tokens = [rng.randint(100, 1024) for _ in range(num_requests)]
    if num_requests == 256 and length_scale == 1.0:
        assert sum(map(len, prompts)) == W1_INPUT_TOKENS, "W1 prompts differ from BENCHMARKS.md"
        assert sum(max_tokens) == W1_OUTPUT_TOKENS, "W1 output lengths differ from BENCHMARKS.md"
    if length_scale != 1.0 or vocab <= 10000:
        prompts = [[t % vocab for t in p[: max(1, int(len(p) * length_scale))]] for p in prompts]
        max_tokens = [max(1, int(m * length_scale)) for m in max_tokens]
    return Workload(prompts, max_tokens)


def sampling_params(wl: Workload) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=m, temperature=TEMPERATURE, ignore_eos=True) for m in wl.output_lens]  # fmt: skip


def time_generate(llm: LLM, wl: Workload) -> tuple[float, int]:
    """(seconds, output tokens) of one `generate` call over the workload."""
    device = llm.engine.device
    common.synchronize(device)
    start = time.perf_counter()
    outs = llm.generate(wl.prompts, sampling_params(wl), use_tqdm=False)
    common.synchronize(device)
    return time.perf_counter() - start, sum(len(o["token_ids"]) for o in outs)


def warm_up(llm: LLM, wl: Workload) -> None:
    """Compile the kernels and grow the allocator: long prefills (chunked), a few decodes.

    The prompts have the workload's lengths but other tokens: the prefix cache must not serve
    the timed run's prompts.
    """
    rng = random.Random(12345)
    vocab = min(10000, llm.engine.model_config.vocab_size)
    prompts = [[rng.randrange(vocab) for _ in p] for p in wl.prompts[:16]]
    time_generate(llm, Workload(prompts, [min(8, m) for m in wl.output_lens[:16]]))


class StepRecorder:
    """Notes each step's shape and launch time (`engine.forward_batch`) while entered; the period
    between launches is the step time the loop sustains (device- or host-bound)."""

    def __init__(self, llm: LLM) -> None:
        self.steps: list[tuple[float, int, int, int]] = []  # (time, batch, tokens, sum seq_lens)
        self._patch = common.patched(llm.engine, "forward_batch", self._wrap)

    def _wrap(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        def record(batch: Batch, mask: Any = None) -> Any:
            self.steps.append(
                (time.perf_counter(), batch.size, batch.num_tokens, sum(batch.seq_lens))
            )
            return forward(batch, mask)

        return record

    def __enter__(self) -> StepRecorder:
        self._patch.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._patch.__exit__(*exc)

    def periods(self, end: float) -> list[tuple[float, int, int, int]]:
        """(seconds until the next launch or `end`, batch, tokens, sum seq_lens) of each step."""
        times = [s[0] for s in self.steps] + [end]
        return [(stop - s[0], *s[1:]) for s, stop in zip(self.steps, times[1:])]

    def breakdown(self, end: float, mb: common.ModelBytes, bandwidth: float) -> list[Row]:
        """Steps grouped as mixed (some prefill) or decode by batch size: count, mean period,
        mean floor of the step's own work (weights + the KV its requests read)."""
        buckets: dict[str, list[float]] = {}  # name -> [steps, seconds, floor seconds, rows]
        for seconds, b, t, ctx in self.periods(end):
            acc = buckets.setdefault(
                "mixed" if t != b else common.batch_bucket(b), [0, 0.0, 0.0, 0]
            )
            acc[0] += 1
            acc[1] += seconds
            acc[2] += (mb.weights + ctx * mb.kv_per_token) / bandwidth
            acc[3] += b
        order = ["mixed", *[common.batch_bucket(b) for b in (1, 9, 33, 129, 257)]]
        return [
            {"kind": name, "steps": int(n), "mean_batch": batch / n, "total_s": seconds,
             "step_ms": seconds / n * 1e3, "floor_ms": floor / n * 1e3,
             "fraction_of_floor": floor / seconds if seconds else 0.0}
            for name in order if name in buckets
            for n, seconds, floor, batch in [buckets[name]]
        ]  # fmt: skip


def run_minisgl(args: Any, wl: Workload, bandwidth: float) -> tuple[Row, LLM]:
    llm = common.make_llm(args)
    warm_up(llm, wl)
    with StepRecorder(llm) as rec:
        seconds, tokens = time_generate(llm, wl)
        end = time.perf_counter()
    engine = llm.engine
    mb = common.ModelBytes.of(engine.model, engine.model_config, engine.pool.dtype)
    floor = common.decode_floor([len(p) for p in wl.prompts], wl.output_lens, mb, bandwidth)
    row = result_row(wl, seconds, tokens, floor)
    keys = ("page_size", "cuda_graph_max_bs", "overlap", "attention_backend", "dtype",
            "kv_cache_dtype", "quantization")  # fmt: skip
    row["config"] = {k: getattr(engine.config, k) for k in keys}
    row["num_pages"] = engine.num_pages
    row["steps"] = rec.breakdown(end, mb, bandwidth)
    return row, llm


def result_row(wl: Workload, seconds: float, tokens: int, floor: common.Floor) -> Row:
    return {
        "requests": len(wl.prompts),
        "input_tokens": wl.input_tokens,
        "output_tokens": tokens,
        "measured_s": seconds,
        "output_tok_per_s": tokens / seconds,
        **floor.as_dict(),
        "floor_tok_per_s": tokens / floor.seconds if floor.seconds else 0.0,
        "fraction_of_floor": floor.seconds / seconds,
    }


# ---- transformers ------------------------------------------------------------------------------


def run_hf(args: Any, wl: Workload) -> Row:
    """The same requests through transformers' continuous batching (sdpa), dummy weights; per
    request max_new_tokens, timed from the first request added to the last result, after a
    two-request warm-up."""
    try:
        import transformers
    except ImportError as e:
        return {"hf_error": f"transformers missing: {e}"}
    row: Row = {"hf_transformers": transformers.__version__, "hf_requests": len(wl.prompts)}
    try:
        manager = _hf_model(args).init_continuous_batching(generation_config=_hf_config(wl))
        manager.start()
        try:
            _hf_collect(manager, Workload([p[:64] for p in wl.prompts[:2]], [4, 4]), "warm", 300)
            start = time.perf_counter()
            tokens, done = _hf_collect(manager, wl, "req", args.hf_timeout)
            seconds = time.perf_counter() - start
        finally:
            manager.stop(block=True, timeout=30)
    except Exception as e:  # transformers' API moves between versions: report, do not crash
        return row | {"hf_error": f"{type(e).__name__}: {str(e)[:300]}"}
    return row | {"hf_api": "init_continuous_batching", "hf_output_tokens": tokens,
                  "hf_finished_requests": done, "hf_complete": done == len(wl.prompts),
                  "hf_seconds": seconds, "hf_output_tok_per_s": tokens / seconds}  # fmt: skip


def _hf_model(args: Any) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(args.model))
    device = common.resolve_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation="sdpa"
            )
        except TypeError:  # transformers before 4.56 names it torch_dtype
            model = AutoModelForCausalLM.from_config(
                config, torch_dtype=dtype, attn_implementation="sdpa"
            )
    return model.eval()


def _hf_config(wl: Workload) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0,
                            max_new_tokens=max(wl.output_lens), eos_token_id=None, pad_token_id=0)  # fmt: skip


def _hf_collect(manager: Any, wl: Workload, tag: str, timeout_s: float) -> tuple[int, int]:
    """Add the requests, wait for their results; (output tokens, finished requests)."""
    ids = [f"{tag}-{i}" for i in range(len(wl.prompts))]
    for rid, p, m in zip(ids, wl.prompts, wl.output_lens):
        manager.add_request(list(p), request_id=rid, max_new_tokens=m)
    pending, tokens = set(ids), 0
    deadline = time.perf_counter() + timeout_s
    while pending and time.perf_counter() < deadline:
        result = manager.get_result(timeout=1.0)
        if result is None:
            if hasattr(manager, "is_running") and not manager.is_running():
                raise RuntimeError("transformers' generation thread stopped")
            continue
        finished = result.is_finished() if hasattr(result, "is_finished") else True
        if finished and result.request_id in pending:
            pending.discard(result.request_id)
            tokens += len(result.generated_tokens)
    return tokens, len(ids) - len(pending)


# ---- main --------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    p = common.engine_parser(__doc__, DEFAULT_MODEL, load_format="dummy")
    p.add_argument("--engine", default="minisgl", choices=["minisgl", "hf"])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--length-scale", type=float, default=1.0, help="shrink lengths (smoke tests)")
    p.add_argument("--hf-requests", type=int, default=32, help="--engine hf: requests run")
    p.add_argument("--hf-timeout", type=float, default=150.0, help="seconds for the HF run")
    args = p.parse_args(argv)
    device = common.resolve_device(args.device)
    wl = w1_workload(args.num_requests, args.length_scale, _vocab_size(args.model))
    if args.engine == "hf":
        wl = wl.head(args.hf_requests)
    bandwidth = common.measure_bandwidth(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    info = {"workload": "W1", "model": Path(args.model).name, **common.device_info(device)}
    print(f"W1 offline throughput: {info['model']} on {info['device']}, {len(wl.prompts)} "
          f"requests, {wl.input_tokens} input / {wl.output_tokens} output tokens; copy "
          f"bandwidth {bandwidth / 1e12:.3f} TB/s")  # fmt: skip
    row, llm = run_minisgl(args, wl, bandwidth)
    steps = row.pop("steps")
    common.print_table("minisgl steps (period between launches vs the step's own floor)", steps)
    result: Row = {**info, "bandwidth_bytes_per_s": bandwidth, **row, "steps": steps}
    common.print_pairs("minisgl", {k: v for k, v in row.items() if not isinstance(v, dict)})
    if args.engine == "hf":
        llm.close()
        del llm
        common.release_memory()
        hf = run_hf(args, wl)
        if hf.get("hf_output_tok_per_s"):
            hf["minisgl_over_hf"] = row["output_tok_per_s"] / hf["hf_output_tok_per_s"]
        common.print_pairs("transformers continuous batching (same requests)", hf)
        result.update(hf)
    common.emit_json(result)


def _vocab_size(model: str) -> int:
    from minisgl.weights import load_model_config, resolve_source

    return load_model_config(resolve_source(model)).vocab_size


if __name__ == "__main__":
    main()
