"""Fused temperature sampling on the GPU: one read of the logits, no [B, V] temporaries.

The torch sampler draws token i with probability p_i by the exponential race argmax(p_i / E_i).
Taking logs, that is the Gumbel-max trick: argmax(logits_i / T - log(-log(u_i))), which needs
neither the softmax nor its normaliser, so one pass over the logits suffices. The uniforms are
the same counter-based hash as `sampler.hashed_uniform` (bit for bit: the per-row key is mixed
on the host, the per-token mix is 32-bit unsigned arithmetic here), so a seeded request draws the
same numbers on either path. Rows with temperature 0 take the plain argmax.

Grid: (rows, vocab blocks). Each program writes its block's best score and index; a tiny torch
argmax over the blocks finishes the job (ties go to the lowest index, as in `torch.argmax`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 4096


@triton.jit
def _fmix32(h):
    # MurmurHash3's finaliser on uint32 (products wrap mod 2^32, shifts are logical).
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _gumbel_argmax_kernel(
    logits_ptr,  # [B, V] fp32 (or bf16 / fp16)
    temperature_ptr,  # [B] fp32, 0 = greedy
    keys_ptr,  # [B] int64, per-row hash keys < 2^32 (`sampler.host_row_key`)
    part_score_ptr,  # [B, NUM_BLOCKS] fp32
    part_index_ptr,  # [B, NUM_BLOCKS] int64
    stride_row,
    vocab,
    NUM_BLOCKS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=mask, other=0.0)
    x = x.to(tl.float32)
    temp = tl.load(temperature_ptr + row)
    key = tl.load(keys_ptr + row).to(tl.uint32)
    h = _fmix32(key + offs.to(tl.uint32) * 0x165667B1)
    u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # in (0, 1), as in the torch hash
    gumbel = -tl.log(-tl.log(u))
    score = tl.where(temp > 0, x / tl.maximum(temp, 1e-5) + gumbel, x)
    score = tl.where(mask, score, float("-inf"))
    best = tl.argmax(score, 0)
    top = tl.max(score, 0)
    out = row * NUM_BLOCKS + blk
    tl.store(part_score_ptr + out, top)
    tl.store(part_index_ptr + out, (blk * BLOCK + best).to(tl.int64))


def gumbel_argmax(
    logits: torch.Tensor,  # [B, V], last dim contiguous
    temperature: torch.Tensor,  # [B] fp32, 0 = greedy
    keys: torch.Tensor,  # [B] int64 per-row hash keys
    block: int = BLOCK_V,
) -> torch.Tensor:  # [B] int64 sampled token ids
    """Sample one token per row from softmax(logits / T) without a host sync."""
    batch, vocab = logits.shape
    assert logits.stride(1) == 1 and temperature.shape == keys.shape == (batch,)
    num_blocks = triton.cdiv(vocab, block)
    part_score = torch.empty(batch, num_blocks, dtype=torch.float32, device=logits.device)
    part_index = torch.empty(batch, num_blocks, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return part_index[:, 0]
    _gumbel_argmax_kernel[(batch, num_blocks)](
        logits, temperature, keys, part_score, part_index, logits.stride(0), vocab,
        NUM_BLOCKS=num_blocks, BLOCK=block, num_warps=8,
    )  # fmt: skip
    pick = part_score.argmax(dim=1, keepdim=True)  # [B, 1]
    return part_index.gather(1, pick).squeeze(1)
