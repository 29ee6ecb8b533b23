"""Reference attention in plain torch: any device, any dtype; the yardstick for the kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl.attention.base import AttentionBackend, AttentionInputs

_QUERY_BLOCK = 512


@dataclass
class TorchMeta:
    inputs: AttentionInputs
    ctx_slots: torch.Tensor  # [B, max_seq_len] int64 KV slot of each context position
    ctx_valid: torch.Tensor  # [B, max_seq_len] bool, position < seq_len


def context_slots(
    page_table: torch.Tensor,
    req_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    max_seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KV slots of positions 0..max_seq_len-1 of each request, and which are inside it."""
    pos = torch.arange(max_seq_len, device=page_table.device)
    num_pages = -(-max_seq_len // page_size)
    pages = page_table[req_slots, :num_pages].long()  # [B, P]
    slots = pages[:, pos // page_size] * page_size + pos % page_size  # [B, S]
    return slots, pos.unsqueeze(0) < seq_lens.unsqueeze(1)


class TorchBackend(AttentionBackend):
    def prepare(self, inputs: AttentionInputs) -> TorchMeta:
        slots, valid = context_slots(
            self.table.page_table,
            inputs.req_slots,
            inputs.seq_lens,
            self.pool.page_size,
            inputs.max_seq_len,
        )
        return TorchMeta(inputs, slots, valid)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: object
    ) -> torch.Tensor:
        assert isinstance(meta, TorchMeta)
        k_cache, v_cache = self.pool.k(layer), self.pool.v(layer)
        loc = meta.inputs.out_loc
        k_cache[loc] = k.to(k_cache.dtype)
        v_cache[loc] = v.to(v_cache.dtype)
        if meta.inputs.is_decode:
            return self._decode(q, k_cache, v_cache, meta)
        return self._extend(q, k_cache, v_cache, meta)

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TorchMeta
    ) -> torch.Tensor:
        keys = k_cache[meta.ctx_slots].transpose(1, 2)  # [B, Hkv, S, D]
        vals = v_cache[meta.ctx_slots].transpose(1, 2)
        mask = meta.ctx_valid[:, None, None, :]  # [B, 1, 1, S]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            keys.to(q.dtype),
            vals.to(q.dtype),
            attn_mask=mask,
            scale=self.sm_scale,
            enable_gqa=True,
        )  # [B, Hq, 1, D]
        return out.squeeze(2)

    def _extend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TorchMeta
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        start = 0
        seq_lens, ext_lens = meta.inputs.seq_lens_host, meta.inputs.extend_lens_host
        for i, (seq_len, n) in enumerate(zip(seq_lens, ext_lens)):
            slots = meta.ctx_slots[i, :seq_len]
            keys = k_cache[slots].transpose(0, 1).to(q.dtype)  # [Hkv, S, D]
            vals = v_cache[slots].transpose(0, 1).to(q.dtype)
            qi = q[start : start + n].transpose(0, 1)  # [Hq, n, D]
            out[start : start + n] = self._causal(qi, keys, vals).transpose(0, 1)
            start += n
        return out

    def _causal(self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        """q [Hq, n, D] are the last n of S positions; keys/vals [Hkv, S, D] -> [Hq, n, D]."""
        n, seq_len = q.shape[1], keys.shape[1]
        if n == seq_len:  # no cached prefix: the fused causal kernel, no [n, S] mask in memory
            return F.scaled_dot_product_attention(
                q, keys, vals, is_causal=True, scale=self.sm_scale, enable_gqa=True
            )
        out = torch.empty_like(q)
        # Long extends over a prefix go in query blocks, so the mask stays [block, S].
        for lo in range(0, n, _QUERY_BLOCK):
            hi = min(n, lo + _QUERY_BLOCK)
            # Query j sits at position seq_len - n + j and sees positions up to itself.
            qpos = torch.arange(seq_len - n + lo, seq_len - n + hi, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= qpos[:, None]
            out[:, lo:hi] = F.scaled_dot_product_attention(
                q[:, lo:hi], keys, vals, attn_mask=mask, scale=self.sm_scale, enable_gqa=True
            )
        return out
