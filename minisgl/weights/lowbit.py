"""Integer checkpoints converted to `QWeight` (w = scales * q + mins per group) at load, exactly
(the checkpoint's fp16 scales times its integers; zero points folded into `mins`):

- GGUF Q4_0, Q4_1, Q8_0 (groups of 32), Q4_K, Q5_K (32), Q6_K (16): the scales come from each
  block's header, q from the `gguf` package's dequantized values (`rint((w - min) / scale)`,
  exact for these small integers), so no block's bit layout is written twice;
- AWQ GEMM (`qweight` [K, N/8] int32, nibbles in the order 0 2 4 6 1 3 5 7, `qzeros`, `scales`):
  w = (q - z) s;
- GPTQ (`qweight` [K/8, N], `qzeros` [G, N/8] stored minus one, `scales`, `g_idx`): with
  `desc_act` the columns are sorted by group (the layer gathers x by the same permutation);
- compressed-tensors pack-quantized (`weight_packed` [N, K/8] int32 of q + 8, `weight_scale`,
  symmetric): w = (q - 8) s.

AWQ and GPTQ are told apart by their shapes (AWQ packs columns, GPTQ rows), so the stream needs
no config: a module's tensors are held until its set is complete (an FP8 layer's
`weight_scale`, which shares compressed-tensors' name, passes on at the end).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from minisgl.kernels.lowbit import QWeight

logger = logging.getLogger(__name__)

GGUF_KERNEL_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
_AWQ_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # column j of a packed int32 sits in nibble _AWQ_ORDER[j]


@functools.cache
def say_dequantized(kind: str) -> None:
    logger.warning("GGUF %s weights have no integer kernel: dequantized at load", kind)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


def _gguf_scales(blocks: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """blocks [N, nb, type_size] uint8 -> scales, mins [N, K / group] fp32."""
    import gguf

    n, nb = blocks.shape[:2]
    d = _f16(blocks[..., 0:2])[..., None]  # [N, nb, 1]
    if kind in ("Q4_0", "Q8_0"):
        return d.reshape(n, -1), (-(8 if kind == "Q4_0" else 128) * d).reshape(n, -1)
    if kind == "Q4_1":
        return d.reshape(n, -1), _f16(blocks[..., 2:4]).reshape(n, -1)
    if kind == "Q6_K":
        d = _f16(blocks[..., 208:210])[..., None]
        s = d * blocks[..., 192:208].copy().view(np.int8).astype(np.float32)
        return s.reshape(n, -1), (-32 * s).reshape(n, -1)
    sc, mn = gguf.quants.Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))  # Q4_K, Q5_K
    dmin = _f16(blocks[..., 2:4])[..., None]
    s = d * sc.reshape(n, nb, 8).astype(np.float32)
    return s.reshape(n, -1), -(dmin * mn.reshape(n, nb, 8).astype(np.float32)).reshape(n, -1)


def gguf_qweight(data: np.ndarray, kind: str) -> QWeight:
    """A GGUF tensor's raw blocks ([N, row bytes] uint8) of one of GGUF_KERNEL_TYPES."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    w = torch.from_numpy(gguf.dequantize(data, qtype).copy())  # [N, K] fp32
    n = w.shape[0]
    s, m = (torch.from_numpy(a) for a in _gguf_scales(data.reshape(n, -1, type_size), kind))
    return _from_values(w, s, m)


def _from_values(w: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> QWeight:
    """q from w = s q + m: exact for the small integers of these formats."""
    g = w.shape[1] // s.shape[1]
    sr, mr = s.repeat_interleave(g, 1), m.repeat_interleave(g, 1)
    q = torch.where(sr != 0, (w - mr) / torch.where(sr != 0, sr, 1.0), 0.0).round_()
    return QWeight(q.clamp_(0, 255).to(torch.uint8), s, m)


def _unpack(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words of eight nibbles (the lowest first) -> uint8 values, 8x longer along `dim`."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    p = packed.int().unsqueeze(dim + 1) >> shifts.view([-1] + [1] * (packed.dim() - dim - 1))
    return (p & 15).flatten(dim, dim + 1).to(torch.uint8)


def _affine(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> QWeight:
    """w = (q - z) s, all [N, ...]."""
    s = scales.float()
    return QWeight(q, s, -zeros.float() * s)


def awq_qweight(t: dict[str, torch.Tensor]) -> QWeight:
    n8 = t["qweight"].shape[1]
    order = torch.arange(n8 * 8).view(-1, 8)[:, _AWQ_ORDER].flatten()
    q = _unpack(t["qweight"], 1)[:, order]  # [K, N]
    z = _unpack(t["qzeros"], 1)[:, order]  # [G, N]
    return _affine(q.t().contiguous(), t["scales"].t(), z.t())


def gptq_qweight(t: dict[str, torch.Tensor]) -> QWeight:
    q = _unpack(t["qweight"], 0).t().contiguous()  # [N, K]
    z = _unpack(t["qzeros"], 1).t().int() + 1  # [N, G]: stored minus one
    w = _affine(q, t["scales"].t(), z)
    g_idx = t.get("g_idx")
    k, group = q.shape[1], q.shape[1] // w.scales.shape[1]
    if g_idx is None or torch.equal(g_idx.long(), torch.arange(k) // group):
        return w
    perm = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[perm], torch.arange(k) // group):
        raise ValueError("GPTQ g_idx does not give every group the same number of columns")
    return w._replace(q=w.q[:, perm].contiguous(), perm=perm)


def ct_qweight(t: dict[str, torch.Tensor]) -> QWeight:
    if "weight_zero_point" in t or "weight_g_idx" in t:
        raise ValueError("compressed-tensors: only symmetric pack-quantized 4-bit is supported")
    n, k = (int(v) for v in t["weight_shape"].tolist())
    q = _unpack(t["weight_packed"], 1)[:, :k]
    return _affine(q.contiguous(), t["weight_scale"], torch.full((n, 1), 8))


# A module's tensor suffixes, (required, optional): compressed-tensors, then AWQ or GPTQ.
_FORMATS = [
    (("weight_packed", "weight_scale", "weight_shape"), ("weight_zero_point", "weight_g_idx")),
    (("qweight", "qzeros", "scales"), ("g_idx",)),
]
_SUFFIXES = {s: i for i, (req, opt) in enumerate(_FORMATS) for s in (*req, *opt)}


def _convert(fmt: int, t: dict[str, torch.Tensor]) -> QWeight:
    if fmt == 0:
        return ct_qweight(t)
    awq = t["qweight"].shape[1] * 8 == t["scales"].shape[1]
    return awq_qweight(t) if awq else gptq_qweight(t)


def integer_modules(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, Any]]:
    """The stream with each AWQ / GPTQ / compressed-tensors module's tensors replaced by one
    `<module>.weight` QWeight; other tensors pass through."""
    held: dict[str, tuple[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in weights:
        prefix, _, suffix = name.rpartition(".")
        fmt = _SUFFIXES.get(suffix)
        if fmt is None:
            yield name, tensor
            continue
        parts = held.setdefault(prefix, (fmt, {}))[1]
        parts[suffix] = tensor
        if all(s in parts for s in (*_FORMATS[fmt][0], *_FORMATS[fmt][1])):
            yield f"{prefix}.weight", _convert(fmt, held.pop(prefix)[1])
    for prefix, (fmt, parts) in held.items():
        if fmt == 0 and "weight_packed" not in parts:  # an FP8 layer's weight_scale: as it is
            yield from ((f"{prefix}.{suffix}", t) for suffix, t in parts.items())
            continue
        missing = [s for s in _FORMATS[fmt][0] if s not in parts]
        if missing:
            raise ValueError(f"{prefix}: the checkpoint lacks its {', '.join(missing)}")
        yield f"{prefix}.weight", _convert(fmt, parts)
