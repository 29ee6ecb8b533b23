"""FP8 KV-cache scales at start-up: the checkpoint's when it has them, else calibrated on a
built-in text when asked (`kv_cache_calibrate` tokens; with the key shift, see `KVPool`), else
1.0."""

from __future__ import annotations

import itertools
import logging
from typing import NamedTuple

import torch
from torch import nn

from minisgl.attention import AttentionInputs
from minisgl.attention.calibrate import CalibrationBackend
from minisgl.engine.calibration_text import TEXT
from minisgl.kernels.fp8 import kv_scale_from_amax
from minisgl.kvcache import KVPool, ReqTable
from minisgl.layers import ForwardContext
from minisgl.weights import ModelSource, load_tokenizer
from minisgl.weights.fp8 import KVScales

logger = logging.getLogger(__name__)

CHUNK_TOKENS = 512  # each chunk is one fresh sequence


def text_ids(src: ModelSource | None, vocab_size: int) -> list[int]:
    """The built-in text in the model's tokens. A model directory without a tokenizer
    (dummy-weight benchmarks; transformers may build an empty one there) gets the text's UTF-8
    bytes as ids."""
    if src is not None:
        try:
            ids = list(load_tokenizer(src).encode(TEXT))
        except (OSError, ValueError, TypeError):
            ids = []
        if len(ids) > 100 and max(ids) < vocab_size:
            return ids
    return [b % vocab_size for b in TEXT.encode()]


def calibration_ids(src: ModelSource | None, vocab_size: int, num_tokens: int) -> list[int]:
    """`num_tokens` ids of the built-in text (repeated if it is shorter)."""
    ids = text_ids(src, vocab_size)
    return list(itertools.islice(itertools.cycle(ids), num_tokens))


class Calibration(NamedTuple):
    scales: torch.Tensor  # [2 (K, V), layers, kv_heads] fp32
    k_shift: torch.Tensor  # [layers, kv_heads, head_dim] fp32


@torch.inference_mode()
def calibrate(
    model: nn.Module,
    pool: KVPool,
    table: ReqTable,
    num_q_heads: int,
    sm_scale: float,
    ids: list[int],
) -> Calibration:
    """Run `ids` through the model twice, in fresh sequences of CHUNK_TOKENS: first for the
    keys' mean per (layer, KV head, channel), the key shift; then for the largest |K - shift|
    and |V| per (layer, KV head), which set the scales."""
    first = _observe(CalibrationBackend(pool, table, num_q_heads, sm_scale), model, ids)
    shift = first.k_mean
    second = _observe(CalibrationBackend(pool, table, num_q_heads, sm_scale, shift), model, ids)
    return Calibration(kv_scale_from_amax(second.amax), shift)


def _observe(backend: CalibrationBackend, model: nn.Module, ids: list[int]) -> CalibrationBackend:
    device = backend.pool.device
    for start in range(0, len(ids), CHUNK_TOKENS):
        chunk = ids[start : start + CHUNK_TOKENS]
        n = len(chunk)
        inputs = AttentionInputs.fresh_prefill(n, device)  # nothing is stored
        positions = torch.arange(n, device=device)
        ids_t = torch.tensor(chunk, dtype=torch.int64, device=device)
        model(ids_t, positions, ForwardContext(backend, backend.prepare(inputs)))
    return backend


def init_kv_scales(
    pool: KVPool,
    model: nn.Module,
    table: ReqTable,
    num_q_heads: int,
    sm_scale: float,
    calibrate_tokens: int,
    checkpoint: KVScales | None,
    src: ModelSource | None,
    vocab_size: int,
) -> None:
    """Set an FP8 pool's scales (nothing to do for a 16-bit pool)."""
    if not pool.quantized:
        return
    if calibrate_tokens:
        ids = calibration_ids(src, vocab_size, calibrate_tokens)
        cal = calibrate(model, pool, table, num_q_heads, sm_scale, ids)
        pool.set_scales(cal.scales[0], cal.scales[1])
        pool.set_k_shift(cal.k_shift)
        logger.info("FP8 KV scales and key shift calibrated on %d tokens", len(ids))
    elif checkpoint is not None:
        pool.set_scales(checkpoint.k.to(pool.device), checkpoint.v.to(pool.device))
        logger.info("FP8 KV scales from the checkpoint")
    else:
        logger.info("FP8 KV cache without scales (1.0): values beyond +-448 saturate")
