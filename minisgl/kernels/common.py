"""Triton building blocks shared by every kernel family (imports Triton): grid sizing, programmatic
dependent launch, the roundings and dot the CPU interpreter needs, split counters."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from minisgl.config import env

# SM count assumed when sizing grids off CUDA (the interpreter): an H100/H200's.
_NOMINAL_NUM_SMS = 132


def is_interpreted(kernel: object) -> bool:
    """True when `kernel` was decorated while TRITON_INTERPRET=1 (it runs on CPU tensors)."""
    return isinstance(kernel, InterpretedFunction)


@functools.cache
def _cuda_num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (a nominal H200 count off CUDA); no host sync."""
    if device.type != "cuda":
        return _NOMINAL_NUM_SMS
    return _cuda_num_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _pdl_capable(index: int) -> bool:
    """Read once per device (a launch calls this: it must cost next to nothing)."""
    if env.DISABLE_PDL.get():
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9 and hasattr(tl.extra.cuda, "gdc_wait")


def pdl_enabled(device: torch.device) -> bool:
    """Programmatic dependent launch for our Triton kernels (Hopper and newer, unless
    `MINISGL_DISABLE_PDL=1`): a kernel may be scheduled while its predecessor still runs and
    waits (`pdl_prologue`) before touching memory, hiding its launch behind that tail."""
    if device.type != "cuda":
        return False
    return _pdl_capable(device.index if device.index is not None else torch.cuda.current_device())


def pdl_args(device: torch.device) -> dict[str, bool]:
    """Launch keywords for a kernel with a `PDL` constexpr that starts with `pdl_prologue`."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(device) else {"PDL": False}


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """First statement of a kernel launched with `pdl_args`: wait until the previous kernel in
    the stream has finished and its writes are visible, then let the next kernel be scheduled
    (it waits the same way, so no kernel runs ahead of one it depends on). A no-op without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def dot_flags(dtype: torch.dtype, kernel: object, kv_fp8: bool = False) -> tuple[bool, bool]:
    """(IEEE, EMULATE_BF16) flags: exact fp32 products (no TF32) for fp32 inputs, and, under
    the CPU interpreter (triton 3.9: it multiplies bf16 operands wrongly and truncates fp32 ->
    bf16 casts), bf16 operands widened to fp32 before `tl.dot` and roundings through
    `round_bf16`, so it reproduces the GPU's numerics. With an FP8 KV cache the dots run in fp16
    (`fp8_operand`): no bf16 to emulate."""
    ieee = dtype == torch.float32
    emulate_bf16 = dtype == torch.bfloat16 and is_interpreted(kernel) and not kv_fp8
    return ieee, emulate_bf16


@triton.jit
def round_e4m3(x):
    """fp32 with |x| <= 448 -> the nearest e4m3 value (ties to even), kept as fp32."""
    bits = x.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    # Below 2^-6 e4m3 is a fixed grid of 2^-9: adding 1.5 * 2^14 (whose fp32 spacing is 2^-9)
    # rounds to it.
    subnormal = (x + 24576.0) - 24576.0
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def round_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), kept as fp32."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def dot(a, b, IEEE: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """a [M, K] @ b [K, N] with fp32 accumulation."""
    if EMULATE_BF16:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


# Per device: the split counters (`split_counters`); a grown buffer keeps the old ones alive
# for the CUDA graphs that captured them.
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least `n` int32 counters that are zero whenever no kernel runs: kernels that split
    their work (decode attention's KV splits, the skinny GEMM's K splits) count finished
    splits in them, and the last split of each output zeroes its counter before the kernel
    finishes. Shared by those kernels (one stream runs them one after another)."""
    held = _COUNTERS.setdefault(device, [])
    if not held or held[-1].numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # A zero-fill inside a capture runs only at replay: eager calls would see garbage.
            raise RuntimeError("run the kernel once before capturing it in a CUDA graph")
        size = max(n, 2 * held[-1].numel() if held else 1024)
        held.append(torch.zeros(size, dtype=torch.int32, device=device))
    return held[-1]
