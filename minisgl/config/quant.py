"""Quantization settings: the KV-cache dtype and how linear / expert weights are stored (FP8, or
4/8-bit integers with group scales), read from the flags and from a checkpoint's
`quantization_config` (or a GGUF's block types), resolved once by pure functions."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8_e4m3")
# int4 / int8: weight-only, round-to-nearest per group at load; dequantize: an integer
# checkpoint (GGUF, AWQ, GPTQ) served in the model dtype, as before integer kernels existed.
QUANTIZATIONS = ("fp8", "int4", "int8", "dequantize")
INT_SOURCES = ("gguf", "awq", "gptq", "compressed-tensors-int")
# --quantization int4|int8: columns per scale (halved until it divides K). 128 on a GPU, where
# scale bytes count against bandwidth (AWQ's and GPTQ's usual group); 32 on a CPU, where the
# int4 kernel runs as fast and SmolLM2-135M's perplexity stays within 0.2% of bf16 (at 64:
# +46%; its weights come from a Q4_1 file, whose groups are 32).
INT_GROUP, CPU_INT_GROUP = 128, 32
FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper: e4m3 conversions and tensor cores
# Rows (tokens) up to which an FP8 linear layer runs the weight-only GEMV (FP8 weights
# dequantized in registers, 16-bit activations) instead of the FP8 tensor-core GEMM with
# per-token activation scales. At one row cuBLASLt's FP8 GEMM read its weights at 1.1-2.7 TB/s
# on the H200 (W7); `python -m minisgl.benchmark.tune fp8-gemm` put the
# crossover at one row on the H200 (the GEMV reads its weights once per row of x).
FP8_GEMV_MAX_ROWS = 1
# Models up to this hidden size run unquantized linear layers of 2-16 rows (a speculative
# verify step, a small decode batch) on CUDA through the skinny tensor-core GEMM
# (`minisgl.kernels.gemv.skinny`) and their dense decoder layers on its fused few-row path, unless
# `skinny_max_rows` says otherwise. H200 (`python -m minisgl.benchmark.tune skinny`): it
# beats cuBLAS on SmolLM2-135M's and Qwen3-0.6B's layers (0.6B o_proj 4.2 against
# 8.3 us at 5 rows) and loses on Llama-3-8B's (down 50.8 against 32.7 us; a K = 4 verify step
# 1.83x a decode step against 1.29x with cuBLAS); SmolLM2's copy workload with K = 8 drafts went
# from 1.60x to 2.14x the tokens/s of plain decoding.
SKINNY_MAX_HIDDEN = 1024


def resolve_skinny_max_rows(requested: int | None, hidden_size: int) -> int:
    """Rows up to which unquantized linear layers take the skinny GEMM (0: never); None: by the
    model's size."""
    if requested is not None:
        return requested
    return 16 if hidden_size <= SKINNY_MAX_HIDDEN else 0


@dataclass(frozen=True)
class QuantConfig:
    """FP8 (e4m3) weights for every linear layer of the decoder blocks and every expert, or
    (`weight_type="int"`) 4/8-bit integer weights with group scales for the dense decoder
    layers (`minisgl.layers.lowbit`; experts stay in the model dtype); the embedding, the LM
    head, norms and the MoE router stay in the model dtype.

    `source`: where the FP8 bytes come from: "online" (a float checkpoint quantized at load, one
    scale per output channel), "fp8" (HF's `quant_method: fp8`: per-tensor `weight_scale` or
    128 x 128 `weight_scale_inv`), "compressed-tensors" (its FP8 schemes). A layer that such a
    checkpoint leaves in 16 bits is quantized at load like an online one. Integer sources:
    "online" (`bits`, `group`), "gguf", "awq", "gptq", "compressed-tensors-int" (pack-quantized).
    """

    source: str = "online"
    weight_block: int | None = None  # 128: one scale per 128 x 128 block; None: per channel
    gemv_max_rows: int = FP8_GEMV_MAX_ROWS
    # The weight-only rows (up to gemv_max_rows, at most 16) take the skinny tensor-core GEMM
    # (`minisgl.kernels.gemv.skinny`) instead of the GEMV; off until measured.
    skinny: bool = False
    weight_type: str = "fp8"  # or "int"
    bits: int = 4  # online integer quantization
    group: int = INT_GROUP

    @property
    def is_int(self) -> bool:
        return self.weight_type == "int"

    def __post_init__(self) -> None:
        if self.source not in ("online", "fp8", "compressed-tensors", *INT_SOURCES):
            raise ValueError(f"quantization source {self.source!r} is not known")
        if self.weight_block not in (None, 128):
            raise ValueError(
                f"FP8 weight blocks of {self.weight_block} are not supported (only 128 x 128)"
            )


def checkpoint_quant(raw: dict[str, Any]) -> QuantConfig | None:
    """The FP8 layout a HF `config.json` declares in `quantization_config`; None without one."""
    qc = raw.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"FP8 checkpoint format {qc.get('fmt')!r}: only e4m3 is supported")
        return QuantConfig(source="fp8", weight_block=_block(qc.get("weight_block_size")))
    if method in ("awq", "gptq"):
        _check_int_checkpoint(method, qc)
        return QuantConfig(source=method, weight_type="int")
    if method == "compressed-tensors":
        if qc.get("format") == "pack-quantized":
            return QuantConfig(source="compressed-tensors-int", weight_type="int")
        return QuantConfig(source="compressed-tensors", weight_block=_ct_block(qc))
    raise ValueError(
        f"checkpoint quantization {method!r} is not supported; supported: fp8, awq, gptq and "
        "compressed-tensors FP8 / pack-quantized (or a 16-bit checkpoint with --quantization)"
    )


def _check_int_checkpoint(method: str, qc: dict[str, Any]) -> None:
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4 or group <= 0 or (method == "awq" and version != "gemm"):
        raise ValueError(
            f"{method} checkpoint with {bits} bits, group {group}, version {version!r}: only "
            "4-bit weights with a positive group size (AWQ: GEMM packing) are supported"
        )


def _block(size: Any) -> int | None:
    if size is None:
        return None
    if list(size) != [128, 128]:
        raise ValueError(f"FP8 weight_block_size {size}: only [128, 128] is supported")
    return 128


def _ct_block(qc: dict[str, Any]) -> int | None:
    """The one weight scheme of a compressed-tensors config (FP8 float, 8 bits)."""
    blocks = set()
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if w.get("type") != "float" or int(w.get("num_bits", 0)) != 8:
            raise ValueError(
                f"compressed-tensors group {name!r} is not FP8 (type {w.get('type')!r}, "
                f"{w.get('num_bits')} bits); only FP8 weights are supported"
            )
        strategy = w.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"compressed-tensors FP8 strategy {strategy!r} is not supported")
        blocks.add(_block(w.get("block_structure")) if strategy == "block" else None)
    if len(blocks) > 1:
        raise ValueError("compressed-tensors groups mix block and per-channel FP8 scales")
    return blocks.pop() if blocks else None


def resolve_quantization(
    requested: str | None,
    checkpoint: QuantConfig | None,
    gemv_max_rows: int,
    skinny: bool = False,
    int_group: int = INT_GROUP,
) -> QuantConfig | None:
    """`--quantization` and the checkpoint's own format -> the format the model is built with.
    An FP8 checkpoint loads as FP8 whether or not `fp8` was asked for."""
    base = checkpoint
    if requested == "dequantize":
        if base is not None and not base.is_int:
            raise ValueError("quantization: dequantize applies to integer checkpoints only")
        return None
    # A GGUF is dequantized unless int4/int8 is asked for: the CPU int4 kernel computes in bf16
    # (0.02-0.07 nats from the fp32 model on SmolLM2) and is slower than fp32 at prefill sizes.
    if requested is None and base is not None and base.source == "gguf":
        return None
    # With int4/int8 a GGUF's integer blocks stay as they are; its float tensors take the format.
    if requested is not None and (base is None or base.source == "gguf"):
        base = QuantConfig() if requested == "fp8" else _online_int(requested, int_group)
    if base is None:
        return None
    return replace(base, gemv_max_rows=gemv_max_rows, skinny=skinny)


def _online_int(requested: str, group: int) -> QuantConfig:
    """int4 / int8 at load (a GGUF keeps its own blocks and quantizes its float tensors)."""
    return QuantConfig(source="online", weight_type="int", bits=int(requested[3:]), group=group)


def check_fp8_device(device: torch.device, what: str) -> None:
    """FP8 on CUDA needs compute capability 8.9 (Ada, Hopper) or newer; CPUs emulate it."""
    if device.type != "cuda":
        return
    error = fp8_capability_error(
        torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device), what
    )
    if error is not None:
        raise ValueError(error)


def fp8_capability_error(gpu: str, capability: tuple[int, int], what: str) -> str | None:
    """Why `what` cannot run on a GPU of this compute capability (None: it can)."""
    if capability >= FP8_MIN_CAPABILITY:
        return None
    major, minor = capability
    return (
        f"{what} needs a GPU of compute capability >= 8.9 (Ada, Hopper); {gpu} is "
        f"{major}.{minor}: drop the FP8 option (or use an unquantized checkpoint)"
    )
