from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from minisgl.config import env
from minisgl.config.cli import auto_or_float, cli_field
from minisgl.config.model import ModelConfig
from minisgl.config.quant import (
    CPU_INT_GROUP,
    FP8_GEMV_MAX_ROWS,
    INT_GROUP,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    QuantConfig,
    check_fp8_device,
    resolve_quantization,
    resolve_skinny_max_rows,
)
from minisgl.core.errors import check_fields, checked

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOAD_FORMATS = ("auto", "dummy")
CACHES = ("radix", "naive")
KV_TORCH_DTYPES = {**DTYPES, "fp8_e4m3": torch.float8_e4m3fn}
SCHEDULE_POLICIES = ("fcfs", "priority")
SPECULATIVE_ALGORITHMS = ("ngram", "draft")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine and scheduler need; "auto" fields are resolved by `resolve`."""

    model: str | None = None  # None: the embedded default model
    dtype: str = cli_field(
        "auto",
        "weight and activation dtype; auto: float32 on CPU, the checkpoint's on GPU",
        "model",
        choices=("auto", *DTYPES),
    )
    device: str = cli_field(
        "auto", "auto, cpu, cuda or cuda:N; auto picks cuda when available", "model"
    )
    load_format: str = cli_field(
        "auto",
        "auto: read the weights; dummy: random weights (benchmarks)",
        "model",
        choices=LOAD_FORMATS,
    )
    kv_cache_dtype: str = cli_field(
        "auto",
        "KV cache storage; auto: the model dtype; fp8_e4m3 holds twice the tokens of bfloat16 "
        "in the same memory (a scale per layer and KV head)",
        "scheduling and memory",
        choices=KV_CACHE_DTYPES,
    )
    kv_cache_calibrate: int = cli_field(
        0,
        "with --kv-cache-dtype fp8_e4m3: set the KV scales from N prefill tokens of a built-in "
        "text at start-up; 0: the checkpoint's KV scales, else 1.0",
        "scheduling and memory",
        metavar="N",
        ge=0,
    )
    quantization: str | None = cli_field(
        None,
        "fp8: linear and expert weights in FP8 e4m3 (16-bit checkpoints quantized at load, one "
        "scale per output channel; needs compute capability >= 8.9 on a GPU); FP8 checkpoints "
        "(quant_method fp8, compressed-tensors) load as FP8 without it; int4/int8: weight-only "
        "integers, round-to-nearest per group of 128 (GGUF, AWQ, GPTQ checkpoints load as "
        "integers without it); dequantize: serve an integer checkpoint in the model dtype",
        "model",
        choices=QUANTIZATIONS,
    )
    # FP8 linear layers with at most this many rows take the weight-only GEMV (see config.quant).
    fp8_gemv_max_rows: int = checked(FP8_GEMV_MAX_ROWS, ge=0)
    # FP8 weight-only rows take the skinny tensor-core GEMM instead of the GEMV.
    fp8_skinny: bool = False
    # Unquantized linear layers with 2..this many rows (at most 16) take the skinny tensor-core GEMM
    # on CUDA instead of cuBLAS (a speculative verify step, small decode batches); 0: off;
    # None: 16 for models up to `SKINNY_MAX_HIDDEN`, else off.
    skinny_max_rows: int | None = checked(None, ge=0, le=16)
    page_size: int = cli_field(
        0, "tokens per KV page; 0: auto (1 on CPU, 32 on GPU)", "scheduling and memory", ge=0
    )
    num_pages: int = cli_field(
        0, "KV pool size in pages; 0: auto, sized from free memory", "scheduling and memory", ge=0
    )
    max_running_requests: int = cli_field(
        256, "requests decoded together at most", "scheduling and memory", ge=1
    )
    max_prefill_tokens: int = cli_field(
        8192,
        "tokens per step while prompts wait: decoding requests' tokens plus prefill chunks "
        "(longer prompts are chunked; prefill keeps at least a quarter)",
        "scheduling and memory",
        ge=1,
    )
    max_context_len: int = cli_field(
        0, "longest prompt + output in tokens; 0: the model's maximum", "scheduling and memory"
    )
    cache: str = cli_field(
        "radix",
        "prefix cache: radix shares KV of common prefixes, naive shares none",
        "scheduling and memory",
        choices=CACHES,
    )
    # The host tier under the radix cache: `minisgl.kvcache.tier`.
    kv_host_gib: float = cli_field(
        0.0,
        "host memory per rank for KV pages the GPU evicts from the radix cache; a later prefix "
        "hit loads them back instead of computing them again; 0: off",
        "scheduling and memory",
        metavar="GIB",
    )
    kv_disk_dir: str | None = cli_field(
        None,
        "with --kv-host-gib: page files here (one per rank) take what the host tier evicts",
        "scheduling and memory",
        metavar="DIR",
    )
    kv_disk_gib: float = cli_field(
        16.0, "size of each rank's --kv-disk-dir file", "scheduling and memory"
    )
    attention_backend: str = "auto"  # auto | torch | triton
    tp_size: int = cli_field(1, "tensor-parallel ranks (GPUs), over all nodes", "model", ge=1)
    # Node 0 holds rank 0, which takes the requests; without `dist_init_addr` a free local port
    # is picked, which only a single node can find.
    nnodes: int = cli_field(1, "hosts the tensor-parallel ranks span", "multi-node")
    node_rank: int = cli_field(0, "this host's index, 0..nnodes-1", "multi-node")
    dist_init_addr: str | None = cli_field(
        None,
        "host:port where node 0 hosts the ranks' rendezvous (required when nnodes > 1; every "
        "node passes node 0's address); default: a free local port",
        "multi-node",
    )
    seed: int = cli_field(
        0, "engine seed (dummy weights; requests without a seed draw their own)", "model"
    )
    mem_fraction: float = cli_field(
        0.9,
        "share of the GPU's memory the engine may fill (weights, CUDA graphs, activations, "
        "then the KV pool with the rest); on a CPU --num-pages sizes the pool",
        "scheduling and memory",
        gt=0,
        le=1,
    )
    cpu_kv_gib: float = checked(2.0, gt=0)  # KV pool size on CPU when num_pages is auto
    cuda_graph_max_bs: int = cli_field(
        256,
        "decode batches up to this size replay CUDA graphs (padded to a captured size); 0 "
        "disables the graphs",
        "scheduling and memory",
        ge=0,
    )
    # `minisgl.engine.piecewise`; off with CUDA graphs.
    piecewise_graph_max_tokens: int = cli_field(
        2048,
        "steps that prefill up to this many tokens replay piecewise CUDA graphs (dense models "
        "at tp 1; attention runs between the pieces); 0 runs them eagerly",
        "scheduling and memory",
        ge=0,
    )
    # `kernels.attention.mixed`; backends without `supports_mixed_step` take the pieces. On the
    # H200 (W4 at 16 req/s) it took a step that prefills from ~15 ms to 3.5-6.8 ms and the ITL
    # p99 from 18.8 to 3.3 ms.
    piecewise_whole_step: bool = cli_field(
        True,
        "capture each prefilling step's token bucket as one graph, attention included (one "
        "mixed-attention kernel per layer; Triton backend); --no-piecewise-whole-step: graphs "
        "of the dense parts with attention launched between them",
        "scheduling and memory",
    )
    overlap: bool = True  # overlap scheduling (CUDA only)
    # `minisgl.scheduler.warmup`; tests and tools may skip it.
    skip_warmup: bool = cli_field(
        False,
        "start without the warm-up steps; the first requests then wait for the kernels' JIT "
        "compiles",
        "serving",
    )
    # Share of a request's remaining max_tokens that admission reserves KV for. It starts at
    # `reserve_ratio` and falls linearly to `min_reserve_ratio` over `reserve_decay_steps` steps
    # (most requests stop well before max_tokens); a retraction puts it back at the start.
    reserve_ratio: float = checked(0.5, gt=0, le=1)
    min_reserve_ratio: float = checked(0.1, gt=0, le=1)
    reserve_decay_steps: int = checked(600, ge=1)
    # `minisgl.scheduler.budget`. On the H200 with whole-step graphs, auto took W4's saturated
    # ITL p99 from 48 to 16 ms at 5% more throughput; the CPU has no prefilling graphs to keep
    # cheap.
    itl_target_ms: float | str | None = cli_field(
        None,
        "inter-token latency target: while requests decode, a step prefills only the prompt "
        "tokens that the measured step-time model says fit in it (long prompts are chunked at "
        "page boundaries; alone, a prompt prefills at full size). auto: 2.5x the predicted "
        "time of the step's decodes alone; 0: off (steps are filled up to "
        "--max-prefill-tokens); default: auto on a GPU, 0 on the CPU",
        "scheduling and memory",
        type=auto_or_float,
        metavar="auto|MS",
    )
    # `minisgl.scheduler.policy`: the waiting queue's order and who is retracted first.
    schedule_policy: str = cli_field(
        "fcfs",
        "fcfs: first come, first served; priority: by each request's `priority` (lower is "
        "more urgent), the least urgent retracted first when KV runs short",
        "scheduling and memory",
        choices=SCHEDULE_POLICIES,
    )
    priority_aging_s: float = cli_field(
        10.0,
        "with --schedule-policy priority: a waiting request gains one priority level per this "
        "many seconds of waiting, so none starves; 0: no aging",
        "scheduling and memory",
        ge=0,
    )
    # Speculative decoding: `minisgl.spec`.
    speculative_algorithm: str | None = cli_field(
        None,
        "ngram: prompt lookup (what followed the last earlier occurrence of the last n "
        "tokens); draft: the model's own first --speculative-draft-layers layers with its "
        "final norm and LM head; default: off",
        "speculative decoding",
        choices=SPECULATIVE_ALGORITHMS,
    )
    speculative_num_draft_tokens: int = cli_field(
        4,
        "drafts verified per request and step at most",
        "speculative decoding",
        metavar="K",
        ge=1,
    )
    speculative_ngram_n: int = cli_field(
        3,
        "ngram: the longest suffix looked up (shorter ones when it is not found)",
        "speculative decoding",
        ge=1,
    )
    # 3: on SmolLM2 (CPU, fp32, K = 8) a chat answer made 4 failed verify steps with 2 and none
    # with 3, and a copy workload kept 6.28 drafts per verify instead of 5.87.
    speculative_ngram_min_n: int = cli_field(
        3,
        "ngram: the shortest suffix looked up (shorter ones match by chance in any text)",
        "speculative decoding",
        ge=1,
    )
    speculative_draft_layers: int = cli_field(
        0,
        "draft: layers of the layer-skip draft; 0: a quarter of the model's, at least one",
        "speculative decoding",
        metavar="L",
        ge=0,
    )
    speculative_draft_model: str | None = cli_field(
        None,
        "draft: a smaller model of the same vocabulary (HF directory or .gguf) instead of the "
        "layer-skip draft; its own weights and KV pool",
        "speculative decoding",
        metavar="PATH",
    )
    speculative_max_batch: int = cli_field(
        8,
        "steps with more decoding requests than this do not speculate",
        "speculative decoding",
        ge=1,
    )
    deterministic: bool = cli_field(
        False,
        "batch-invariant numerics: a request's token ids and logprobs are bit-identical "
        "whatever runs beside it (batch, prefill chunks, prefix-cache hits, speculation, "
        "overlap); slower. Refused where it cannot hold: tp > 1, a mixture of experts, "
        "quantized weights",
        "model",
    )
    show_progress: bool = True
    # The KV debug mode (`MINISGL_DEBUG_KV=1`; the tests turn it on): pages given back to the
    # allocator are overwritten with NaN, and giving back a page or slot that a step in flight
    # references fails an assertion.
    debug_kv: bool = False

    def __post_init__(self) -> None:
        check_fields(self)
        if self.deterministic and self.tp_size > 1:
            raise ValueError(
                "deterministic: the all-reduce at tp_size > 1 sums in an order that is not "
                "fixed; run it at tp_size 1"
            )
        t = self.itl_target_ms
        if not (t is None or t == "auto" or (isinstance(t, (int, float)) and t >= 0)):
            raise ValueError(
                f"itl_target_ms: must be >= 0 (0 turns the target off), 'auto' or None (the "
                f"machine's default), got {t!r}"
            )
        if self.kv_cache_calibrate and self.kv_cache_dtype != "fp8_e4m3":
            raise ValueError(
                "kv_cache_calibrate: only an fp8_e4m3 KV cache has scales to calibrate; "
                "pass kv_cache_dtype='fp8_e4m3' too"
            )
        self._check_distributed()
        self._check_kv_tiers()
        self._check_speculative()

    def _check_kv_tiers(self) -> None:
        if self.kv_host_gib < 0 or self.kv_disk_gib <= 0:
            raise ValueError(
                f"kv_host_gib must be >= 0 and kv_disk_gib > 0, got {self.kv_host_gib} and "
                f"{self.kv_disk_gib}"
            )
        if self.kv_host_gib and self.cache != "radix":
            raise ValueError("kv_host_gib: the host tier sits under the radix cache (cache radix)")
        if self.kv_disk_dir is not None and not self.kv_host_gib:
            raise ValueError("kv_disk_dir: the disk tier sits under the host tier (kv_host_gib)")

    def _check_speculative(self) -> None:
        if not self.speculative_ngram_min_n <= self.speculative_ngram_n:
            raise ValueError(
                "speculative_ngram_min_n: must be between 1 and speculative_ngram_n "
                f"({self.speculative_ngram_n}), got {self.speculative_ngram_min_n}"
            )
        if self.speculative_draft_model is not None:
            if self.speculative_algorithm != "draft":
                raise ValueError(
                    "speculative_draft_model: needs speculative_algorithm 'draft', got "
                    f"{self.speculative_algorithm!r}"
                )
            if self.tp_size != 1:
                raise ValueError("speculative_draft_model: only at tp_size 1 for now")

    def _check_distributed(self) -> None:
        if self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ValueError(
                f"nnodes: {self.nnodes} nodes cannot hold tp_size {self.tp_size} ranks evenly; "
                "pass a divisor of tp_size"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank: must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("dist_init_addr: several nodes need rank 0's host:port to meet at")
        if self.dist_init_addr is not None:
            split_host_port(self.dist_init_addr)

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def torch_device(self) -> torch.device:
        assert self.device != "auto", "resolve the config first"
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        assert self.dtype != "auto", "resolve the config first"
        return DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        assert self.kv_cache_dtype != "auto", "resolve the config first"
        return KV_TORCH_DTYPES[self.kv_cache_dtype]


def split_host_port(addr: str) -> tuple[str, int]:
    """Split `host:port`; raises ValueError naming the field when malformed."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"dist_init_addr: expected host:port, got {addr!r}")
    return host, int(port)


def resolve_engine_config(cfg: EngineConfig, model_dtype: str) -> EngineConfig:
    """Fill in the "auto" fields that depend on the machine and the model (pure)."""
    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":  # name the index: torch.cuda.set_device refuses a bare "cuda"
        device = f"cuda:{torch.cuda.current_device()}"
    on_cuda = device.startswith("cuda")
    dtype = cfg.dtype
    if dtype == "auto":
        # CPUs run fp32 fastest and it matches the reference exactly; GPUs use the checkpoint's.
        dtype = model_dtype if on_cuda and model_dtype in DTYPES else "float32"
        if on_cuda and dtype == "float32":
            dtype = "bfloat16"
    # H200 decode sweep (W3): 1: 3.68, 16: 4.17, 32: 4.25, 64: 4.30 TB/s; 32 is
    # within 1% of 64 and halves what a prefix match loses to page rounding.
    page_size = cfg.page_size or (32 if on_cuda else 1)
    backend = cfg.attention_backend
    if backend == "auto":
        backend = "triton" if on_cuda else "torch"
    kv_dtype = dtype if cfg.kv_cache_dtype == "auto" else cfg.kv_cache_dtype
    auto_target: float | str = "auto" if on_cuda else 0.0
    return replace(
        cfg,
        device=device,
        dtype=dtype,
        kv_cache_dtype=kv_dtype,
        page_size=page_size,
        attention_backend=backend,
        overlap=cfg.overlap and on_cuda,
        cuda_graph_max_bs=cfg.cuda_graph_max_bs if on_cuda else 0,
        itl_target_ms=cfg.itl_target_ms if cfg.itl_target_ms is not None else auto_target,
    )


def apply_env_switches(cfg: EngineConfig) -> EngineConfig:
    """`MINISGL_DISABLE_OVERLAP` / `MINISGL_DISABLE_CUDA_GRAPH` turn those features off;
    `MINISGL_DEBUG_KV` turns the KV debug mode on (`minisgl.config.env`). Every switch is
    checked here (a bad value raises ValueError naming it)."""
    env.check_all()
    if env.DISABLE_OVERLAP.get():
        cfg = replace(cfg, overlap=False)
    if env.DISABLE_CUDA_GRAPH.get():
        cfg = replace(cfg, cuda_graph_max_bs=0)
    if env.DEBUG_KV.get():
        cfg = replace(cfg, debug_kv=True)
    return cfg


def resolve_model_quantization(mcfg: ModelConfig, cfg: EngineConfig) -> ModelConfig:
    """The model config with the weight format the engine builds it in and the rows up to which
    its linear layers take the skinny GEMM (pure, except that an FP8 choice on CUDA checks the
    device), checking the device for an FP8 KV cache too and refusing what `--deterministic`
    cannot hold."""
    group = INT_GROUP if cfg.torch_device.type == "cuda" else CPU_INT_GROUP
    quant = resolve_quantization(
        cfg.quantization, mcfg.quant, cfg.fp8_gemv_max_rows, cfg.fp8_skinny, group
    )
    if quant is not None and not quant.is_int:
        check_fp8_device(cfg.torch_device, "FP8 weights")
    if cfg.kv_cache_dtype == "fp8_e4m3":
        check_fp8_device(cfg.torch_device, "--kv-cache-dtype fp8_e4m3")
    rows = resolve_skinny_max_rows(cfg.skinny_max_rows, mcfg.hidden_size)
    if cfg.deterministic:
        check_deterministic(mcfg, quant, cfg.torch_device, cfg.attention_backend)
    return replace(mcfg, quant=quant, skinny_max_rows=rows)


def check_deterministic(
    mcfg: ModelConfig, quant: QuantConfig | None, device: torch.device, backend: str
) -> None:
    """Refuse what `--deterministic` cannot make batch-invariant (ValueError saying so)."""
    if device.type == "cuda" and backend != "triton":
        raise ValueError(
            "deterministic: on a GPU only the Triton attention kernels sum in a fixed order "
            "(the torch backend's batched matmuls go to cuBLAS); pass attention_backend triton"
        )
    if mcfg.moe is not None:
        raise ValueError(
            "deterministic: the mixture-of-experts kernels group tokens by expert, so a "
            "token's sums depend on the batch; use a dense model or drop --deterministic"
        )
    if quant is not None:
        raise ValueError(
            "deterministic: quantized weights take kernels (and FP8 an activation rounding) "
            "chosen by the row count; serve the model in its 16-bit dtype or drop "
            "--deterministic"
        )
