from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from minisgl.config import env
from minisgl.config.model import ModelConfig
from minisgl.config.quant import (
    CPU_INT_GROUP,
    FP8_GEMV_MAX_ROWS,
    INT_GROUP,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    check_fp8_device,
    resolve_quantization,
    resolve_skinny_max_rows,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOAD_FORMATS = ("auto", "dummy")
KV_TORCH_DTYPES = {**DTYPES, "fp8_e4m3": torch.float8_e4m3fn}
SCHEDULE_POLICIES = ("fcfs", "priority")
SPECULATIVE_ALGORITHMS = ("ngram", "draft")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine and scheduler need; "auto" fields are resolved by `resolve`."""

    model: str | None = None  # None: the embedded default model
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    load_format: str = "auto"  # auto (from the files) | dummy (random weights)
    # KV cache storage: auto (the model dtype) | bfloat16 | float16 | float32 | fp8_e4m3 (one
    # byte per value, a scale per layer and KV head; twice the tokens in the same memory).
    kv_cache_dtype: str = "auto"
    # FP8 KV scales from this many prefill tokens of a built-in text at start-up (0: the
    # checkpoint's scales when it has them, else 1.0).
    kv_cache_calibrate: int = 0
    # fp8: linear and expert weights in FP8 e4m3 (16-bit checkpoints are quantized at load, one
    # scale per output channel); int4 / int8: weight-only integers per group (`config.quant`);
    # dequantize: integer checkpoints in the model dtype; None: as the checkpoint is (FP8
    # checkpoints stay FP8; GGUF, AWQ, GPTQ integer weights stay integers).
    quantization: str | None = None
    # FP8 linear layers with at most this many rows take the weight-only GEMV (see config.quant).
    fp8_gemv_max_rows: int = FP8_GEMV_MAX_ROWS
    # FP8 weight-only rows take the skinny tensor-core GEMM instead of the GEMV.
    fp8_skinny: bool = False
    # Unquantized linear layers with 2..this many rows (at most 16) take the skinny tensor-core GEMM
    # on CUDA instead of cuBLAS (a speculative verify step, small decode batches); 0: off;
    # None: 16 for models up to `SKINNY_MAX_HIDDEN`, else off.
    skinny_max_rows: int | None = None
    page_size: int = 0  # 0: auto (1 on CPU, chosen by measurement on CUDA)
    num_pages: int = 0  # 0: auto, sized from memory
    max_running_requests: int = 256
    # Tokens of a step that prefills: its decodes plus prompt chunks (at least a quarter).
    max_prefill_tokens: int = 8192
    max_context_len: int = 0  # 0: the model's max_position_embeddings
    cache: str = "radix"  # radix | naive
    # The host tier under the radix cache (`minisgl.kvcache.tier`): GiB of (pinned) host memory
    # per rank that keeps the pages the device evicts and loads them back on a hit; 0: off.
    kv_host_gib: float = 0.0
    # A third tier below it: page files in this directory (one per rank), `kv_disk_gib` each.
    kv_disk_dir: str | None = None
    kv_disk_gib: float = 16.0
    attention_backend: str = "auto"  # auto | torch | triton
    tp_size: int = 1
    # Tensor-parallel ranks spread evenly over `nnodes` hosts; node 0 holds rank 0, which takes
    # the requests. `dist_init_addr` (host:port) is rank 0's rendezvous; None picks a free
    # local port, which only a single node can find.
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    seed: int = 0
    mem_fraction: float = 0.9
    cpu_kv_gib: float = 2.0  # KV pool size on CPU when num_pages is auto
    cuda_graph_max_bs: int = 256  # 0 disables CUDA graphs
    # Steps that prefill up to this many tokens run as piecewise CUDA graphs (dense models at
    # tp = 1; `minisgl.engine.piecewise`); 0: eagerly. Off with CUDA graphs.
    piecewise_graph_max_tokens: int = 2048
    # ... each as ONE graph of the whole forward, attention included (`kernels.attention.mixed`; backends
    # with `supports_mixed_step`, else the pieces with attention between them). On the H200 (W4
    # at 16 req/s) it took a step that prefills from ~15 ms to 3.5-6.8 ms and the ITL p99 from
    # 18.8 to 3.3 ms.
    piecewise_whole_step: bool = True
    overlap: bool = True  # overlap scheduling (CUDA only)
    # The engine runs a few synthetic steps at start-up so serving never waits on a JIT
    # compile of a kernel variant (`minisgl.scheduler.warmup`); tests and tools may skip them.
    skip_warmup: bool = False
    # Share of a request's remaining max_tokens that admission reserves KV for. It starts at
    # `reserve_ratio` and falls linearly to `min_reserve_ratio` over `reserve_decay_steps` steps
    # (most requests stop well before max_tokens); a retraction puts it back at the start.
    reserve_ratio: float = 0.5
    min_reserve_ratio: float = 0.1
    reserve_decay_steps: int = 600
    # Inter-token latency target (`minisgl.scheduler.budget`): while requests decode, a step
    # prefills only the prompt tokens that the step-time model says fit in it. "auto": 2.5x the
    # predicted time of the step's decodes alone; milliseconds; 0: off (the token limit alone).
    # None (the default): auto on CUDA, off on the CPU. On the H200 with whole-step graphs,
    # auto took W4's saturated ITL p99 from 48 to 16 ms at 5% more throughput; the CPU has no
    # prefilling graphs to keep cheap.
    itl_target_ms: float | str | None = None
    # fcfs | priority (`minisgl.scheduler.policy`): the waiting queue's order and who is
    # retracted first; under priority a request gains one level per `priority_aging_s` seconds
    # of waiting (0: never).
    schedule_policy: str = "fcfs"
    priority_aging_s: float = 10.0
    # Speculative decoding (`minisgl.spec`): None (off) | ngram (prompt lookup: the tokens that
    # followed the last occurrence of the request's last n tokens) | draft (the target's own
    # first `speculative_draft_layers` layers with its final norm and LM head; or, with
    # `speculative_draft_model`, that smaller model of the same vocabulary). Each verify step
    # scores up to `speculative_num_draft_tokens` drafts per request; batches of more than
    # `speculative_max_batch` decoding requests, and requests whose drafts are mostly rejected,
    # decode plainly.
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 4
    speculative_ngram_n: int = 3  # longest suffix looked up (shorter ones after it, down to:)
    # 3: on SmolLM2 (CPU, fp32, K = 8) a chat answer made 4 failed verify steps with 2 and none
    # with 3, and a copy workload kept 6.28 drafts per verify instead of 5.87.
    speculative_ngram_min_n: int = 3
    speculative_draft_layers: int = 0  # 0: auto (a quarter of the layers, at least one)
    speculative_draft_model: str | None = None  # an HF directory or .gguf (algorithm "draft")
    speculative_max_batch: int = 8
    show_progress: bool = True
    # The KV debug mode (`MINISGL_DEBUG_KV=1`; the tests turn it on): pages given back to the
    # allocator are overwritten with NaN, and giving back a page or slot that a step in flight
    # references fails an assertion.
    debug_kv: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype: {self.dtype!r} is not one of auto, {', '.join(DTYPES)}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format: {self.load_format!r} is not one of {LOAD_FORMATS}")
        if self.cache not in ("radix", "naive"):
            raise ValueError(f"cache: {self.cache!r} is not one of radix, naive")
        if self.page_size < 0 or self.num_pages < 0:
            raise ValueError("page_size and num_pages must be >= 0 (0 means auto)")
        if self.max_running_requests < 1 or self.max_prefill_tokens < 1:
            raise ValueError("max_running_requests and max_prefill_tokens must be >= 1")
        if self.tp_size < 1:
            raise ValueError(f"tp_size: must be >= 1, got {self.tp_size}")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ValueError(f"mem_fraction: must be in (0, 1], got {self.mem_fraction}")
        if self.cpu_kv_gib <= 0:
            raise ValueError(f"cpu_kv_gib: must be > 0, got {self.cpu_kv_gib}")
        if self.cuda_graph_max_bs < 0:
            raise ValueError(f"cuda_graph_max_bs: must be >= 0, got {self.cuda_graph_max_bs}")
        if self.piecewise_graph_max_tokens < 0:
            raise ValueError(
                f"piecewise_graph_max_tokens: must be >= 0, got {self.piecewise_graph_max_tokens}"
            )
        if not 0.0 < self.reserve_ratio <= 1.0:
            raise ValueError(f"reserve_ratio: must be in (0, 1], got {self.reserve_ratio}")
        if not 0.0 < self.min_reserve_ratio <= 1.0:
            raise ValueError(f"min_reserve_ratio: must be in (0, 1], got {self.min_reserve_ratio}")
        if self.reserve_decay_steps < 1:
            raise ValueError(f"reserve_decay_steps: must be >= 1, got {self.reserve_decay_steps}")
        self._check_distributed()
        self._check_kv_tiers()
        self._check_fp8()
        self._check_scheduling()
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
        algo = self.speculative_algorithm
        if algo is not None and algo not in SPECULATIVE_ALGORITHMS:
            raise ValueError(
                f"speculative_algorithm: {algo!r} is not one of "
                f"{', '.join(SPECULATIVE_ALGORITHMS)} (or None: off)"
            )
        if self.speculative_num_draft_tokens < 1:
            raise ValueError(
                f"speculative_num_draft_tokens: must be >= 1, got "
                f"{self.speculative_num_draft_tokens}"
            )
        if self.speculative_ngram_n < 1:
            raise ValueError(f"speculative_ngram_n: must be >= 1, got {self.speculative_ngram_n}")
        if not 1 <= self.speculative_ngram_min_n <= self.speculative_ngram_n:
            raise ValueError(
                "speculative_ngram_min_n: must be between 1 and speculative_ngram_n "
                f"({self.speculative_ngram_n}), got {self.speculative_ngram_min_n}"
            )
        if self.speculative_draft_layers < 0:
            raise ValueError(
                "speculative_draft_layers: must be >= 0 (0: auto), got "
                f"{self.speculative_draft_layers}"
            )
        if self.speculative_max_batch < 1:
            raise ValueError(
                f"speculative_max_batch: must be >= 1, got {self.speculative_max_batch}"
            )
        if self.speculative_draft_model is not None:
            if self.speculative_algorithm != "draft":
                raise ValueError(
                    "speculative_draft_model: needs speculative_algorithm 'draft', got "
                    f"{self.speculative_algorithm!r}"
                )
            if self.tp_size != 1:
                raise ValueError("speculative_draft_model: only at tp_size 1 for now")

    def _check_scheduling(self) -> None:
        t = self.itl_target_ms
        if not (t is None or t == "auto" or (isinstance(t, (int, float)) and t >= 0)):
            raise ValueError(
                f"itl_target_ms: must be >= 0 (0 turns the target off), 'auto' or None (the "
                f"machine's default), got {t!r}"
            )
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy: {self.schedule_policy!r} is not one of "
                f"{', '.join(SCHEDULE_POLICIES)}"
            )
        if not self.priority_aging_s >= 0:
            raise ValueError(
                f"priority_aging_s: must be >= 0 (0: no aging), got {self.priority_aging_s}"
            )

    def _check_fp8(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype: {self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}"
            )
        if self.kv_cache_calibrate < 0:
            raise ValueError(f"kv_cache_calibrate: must be >= 0, got {self.kv_cache_calibrate}")
        if self.kv_cache_calibrate and self.kv_cache_dtype != "fp8_e4m3":
            raise ValueError(
                "kv_cache_calibrate: only an fp8_e4m3 KV cache has scales to calibrate; "
                "pass kv_cache_dtype='fp8_e4m3' too"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization: {self.quantization!r} is not one of {QUANTIZATIONS}")
        if self.fp8_gemv_max_rows < 0:
            raise ValueError(f"fp8_gemv_max_rows: must be >= 0, got {self.fp8_gemv_max_rows}")
        if self.skinny_max_rows is not None and not 0 <= self.skinny_max_rows <= 16:
            raise ValueError(
                f"skinny_max_rows: must be between 0 (off) and 16, got {self.skinny_max_rows}"
            )

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
    device), checking the device for an FP8 KV cache too."""
    group = INT_GROUP if cfg.torch_device.type == "cuda" else CPU_INT_GROUP
    quant = resolve_quantization(
        cfg.quantization, mcfg.quant, cfg.fp8_gemv_max_rows, cfg.fp8_skinny, group
    )
    if quant is not None and not quant.is_int:
        check_fp8_device(cfg.torch_device, "FP8 weights")
    if cfg.kv_cache_dtype == "fp8_e4m3":
        check_fp8_device(cfg.torch_device, "--kv-cache-dtype fp8_e4m3")
    rows = resolve_skinny_max_rows(cfg.skinny_max_rows, mcfg.hidden_size)
    return replace(mcfg, quant=quant, skinny_max_rows=rows)
