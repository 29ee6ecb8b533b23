"""Reference attention in plain torch: any device, any dtype; the yardstick for the kernels.

It is also the CPU path, so the per-step work is done once in `prepare` (context slots, masks,
length groups) and each of the model's layers only gathers K/V and calls SDPA. An FP8 pool holds
K / scale and V / scale in e4m3 (`minisgl.kernels.fp8`); every read multiplies the scale back,
new tokens included, so a prefill attends to the same values a later decode reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from minisgl.attention.base import AttentionBackend, AttentionInputs
from minisgl.kernels.fp8 import dequantize_kv, quantize_kv, store_v_rows, v_rows

_QUERY_BLOCK = 512
# What one more decode group costs (its gathers, SDPA call and scatter), in padded context
# positions. On the 2-core W6 machine (32 requests of 32-256 tokens) 4-7 groups were 5% faster
# per decode step than one padded group, and costs from 64 to 256 did about equally well.
# Elsewhere the torch backend is a reference and keeps one group.
_GROUP_COST = {"cpu": 256}
_MAX_GROUP_CANDIDATES = 32
# Keys per block of the batch-invariant attention (`invariant_attention`).
_INVARIANT_KEYS = 64


@dataclass
class DecodeGroup:
    """Decode requests attended together, their contexts padded to the longest of them."""

    rows: torch.Tensor | None  # [b] int64 batch rows; None: the whole batch, in order
    slots: torch.Tensor  # [b * width] int64 KV slot of each context position (padding: slot 0)
    bias: torch.Tensor | None  # [b, 1, 1, width] 0 / -inf, pool dtype; None: no padding
    size: int
    width: int


@dataclass
class TorchMeta:
    inputs: AttentionInputs
    ctx_slots: torch.Tensor  # [B, max_seq_len] int64 KV slot of each context position
    groups: list[DecodeGroup] = field(default_factory=list)  # decode steps only
    # Deterministic mode: each new token's batch row [T] and position [T].
    token_rows: torch.Tensor | None = None
    token_pos: torch.Tensor | None = None


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
    if page_size == 1:
        slots = pages
    else:
        slots = pages[:, pos // page_size] * page_size + pos % page_size  # [B, S]
    return slots, pos.unsqueeze(0) < seq_lens.unsqueeze(1)


def plan_groups(seq_lens: list[int], group_cost: int) -> list[list[int]]:
    """Split decode rows into groups of similar length: minimises the padded positions
    (sum of size x longest) plus `group_cost` per group. Returns each group's rows."""
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    lens = [seq_lens[i] for i in order]
    n = len(lens)
    # Groups end only where the length changes (at most _MAX_GROUP_CANDIDATES of those).
    ends = [i + 1 for i in range(n - 1) if lens[i] != lens[i + 1]] + [n]
    if len(ends) > _MAX_GROUP_CANDIDATES:
        step = len(ends) / _MAX_GROUP_CANDIDATES
        ends = sorted({ends[int(k * step)] for k in range(_MAX_GROUP_CANDIDATES)} | {n})
    # best[j]: cheapest cost of rows order[:ends[j]]; back[j]: where its last group starts.
    best: list[int] = []
    back: list[int] = []
    for j, end in enumerate(ends):
        cost, start = (end * lens[end - 1] + group_cost), -1
        for i in range(j):
            c = best[i] + (end - ends[i]) * lens[end - 1] + group_cost
            if c < cost:
                cost, start = c, i
        best.append(cost)
        back.append(start)
    groups: list[list[int]] = []
    j = len(ends) - 1
    while j >= 0:
        lo = ends[back[j]] if back[j] >= 0 else 0
        groups.append(order[lo : ends[j]])
        j = back[j]
    return groups[::-1]


@dataclass
class _LayerKV:
    """One layer's caches; an FP8 pool's come with their per-head (k, v) scales."""

    k_cache: torch.Tensor  # [slots, Hkv, D]
    v_cache: torch.Tensor  # the same; an FP8 pool's [pages, Hkv, D, page_size] (`KVPool`)
    scales: tuple[torch.Tensor, torch.Tensor] | None  # [Hkv] fp32 each
    k_shift: torch.Tensor | None  # [Hkv, D] fp32, subtracted from keys before they are stored

    def store(
        self, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new rows at slots `loc` [T]; returns them as stored (cache dtype)."""
        if self.scales is None:
            k, v = k.to(self.k_cache.dtype), v.to(self.v_cache.dtype)
            self.k_cache.index_copy_(0, loc, k)
            self.v_cache.index_copy_(0, loc, v)
            return k, v
        k, v = quantize_kv(k, self.scales[0], self.k_shift), quantize_kv(v, self.scales[1])
        # index_copy_ has no e4m3 kernel on the CPU: copy the bytes.
        self.k_cache.view(torch.uint8).index_copy_(0, loc, k.view(torch.uint8))
        store_v_rows(self.v_cache, loc, v)
        return k, v

    def dequantize(self, x: torch.Tensor, which: int, dtype: torch.dtype) -> torch.Tensor:
        """Stored rows [..., Hkv, D] -> values in `dtype` (which: 0 for K, 1 for V; keys stay
        shifted: attention does not see the shift)."""
        if self.scales is None:
            return x.to(dtype)
        return dequantize_kv(x, self.scales[which], dtype)

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [len(slots), Hkv, D] at `slots`, in `dtype`."""
        keys = self.dequantize(self.k_cache.index_select(0, slots), 0, dtype)
        return keys, self.dequantize(v_rows(self.v_cache, slots), 1, dtype)


class TorchBackend(AttentionBackend):
    def prepare(self, inputs: AttentionInputs) -> TorchMeta:
        slots, valid = context_slots(
            self.table.page_table,
            inputs.req_slots,
            inputs.seq_lens,
            self.pool.page_size,
            inputs.max_seq_len,
        )
        if self.deterministic:
            # Padded to whole key blocks; padding and past-the-end positions read the spare
            # slot (finite, weighed 0).
            spare = self.pool.spare_loc
            slots = slots.masked_fill(~valid, spare)
            slots = F.pad(slots, (0, -slots.shape[1] % _INVARIANT_KEYS), value=spare)
            return TorchMeta(inputs, slots, [], *token_rows_and_positions(inputs))
        meta = TorchMeta(inputs, slots)
        if inputs.is_decode:
            meta.groups = self._decode_groups(inputs, slots, valid)
        return meta

    def _decode_groups(
        self, inputs: AttentionInputs, slots: torch.Tensor, valid: torch.Tensor
    ) -> list[DecodeGroup]:
        lens = inputs.seq_lens_host
        cost = _GROUP_COST.get(slots.device.type)
        plan = [list(range(len(lens)))] if cost is None else plan_groups(lens, cost)
        whole = len(plan) == 1
        groups = []
        for rows in plan:
            width = max(lens[i] for i in rows)
            idx = None if whole else torch.tensor(rows, dtype=torch.int64).to(slots.device)
            g_slots = slots[:, :width] if idx is None else slots[idx, :width]
            g_valid = valid[:, :width] if idx is None else valid[idx, :width]
            bias = None
            if any(lens[i] != width for i in rows):
                # e4m3 has no -inf: an FP8 pool's masks are fp32 (converted to q's dtype on use)
                dtype = torch.float32 if self.pool.quantized else self.pool.dtype
                bias = torch.zeros(g_valid.shape, dtype=dtype, device=slots.device)
                bias = bias.masked_fill_(~g_valid, float("-inf"))[:, None, None, :]
            # Padding positions read the pool's spare slot: the bias hides what it holds, but
            # it must be finite (0 x NaN is NaN), and a freed page may hold anything.
            flat = g_slots.masked_fill(~g_valid, self.pool.spare_loc).reshape(-1)
            groups.append(DecodeGroup(idx, flat, bias, len(rows), width))
        return groups

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: int,
        meta: object,
    ) -> torch.Tensor:
        assert isinstance(meta, TorchMeta)
        assert k is not None and v is not None, "the torch backend stores K/V itself (no kv_store)"
        pool = self.pool
        kv = _LayerKV(pool.k(layer), pool.v(layer), pool.scales(layer), pool.k_shift(layer))
        new_k, new_v = kv.store(meta.inputs.out_loc, k, v)
        if meta.token_rows is not None:
            assert meta.token_pos is not None
            return invariant_attention(
                q, kv, meta.ctx_slots, meta.token_rows, meta.token_pos, self.sm_scale
            )
        if meta.inputs.is_decode:
            return self._decode(q, kv, meta)
        return self._extend(q, new_k, new_v, kv, meta)

    def _decode(self, q: torch.Tensor, kv: _LayerKV, meta: TorchMeta) -> torch.Tensor:
        if len(meta.groups) == 1:
            return self._decode_group(q, kv, meta.groups[0])
        out = torch.empty_like(q)
        for g in meta.groups:
            assert g.rows is not None
            res = self._decode_group(q.index_select(0, g.rows), kv, g)
            out.index_copy_(0, g.rows, res)
        return out

    def _decode_group(self, q: torch.Tensor, kv: _LayerKV, g: DecodeGroup) -> torch.Tensor:
        """q [b, Hq, D] -> [b, Hq, D] over the group's padded contexts."""
        b, hq, d = q.shape
        hkv = kv.k_cache.shape[1]
        keys, vals = kv.read(g.slots, q.dtype)
        keys, vals = keys.view(b, g.width, hkv, d), vals.view(b, g.width, hkv, d)
        bias = None if g.bias is None else g.bias.to(q.dtype)
        # The query heads that share a KV head become that head's query rows: one read of K/V.
        out = F.scaled_dot_product_attention(
            q.reshape(b, hkv, hq // hkv, d),
            keys.transpose(1, 2),  # [b, Hkv, width, D]
            vals.transpose(1, 2),
            attn_mask=bias,
            scale=self.sm_scale,
        )  # [b, Hkv, Hq/Hkv, D]
        return out.reshape(b, hq, d)

    def _extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: _LayerKV, meta: TorchMeta
    ) -> torch.Tensor:
        """k, v [T, Hkv, D]: the new tokens as the pool holds them (`_LayerKV.store`)."""
        out = torch.empty_like(q)
        start = 0
        seq_lens, ext_lens = meta.inputs.seq_lens_host, meta.inputs.extend_lens_host
        for i, (seq_len, n) in enumerate(zip(seq_lens, ext_lens)):
            if n == seq_len:  # no cached prefix: the new K/V are the whole context
                keys = kv.dequantize(k[start : start + n], 0, q.dtype)
                vals = kv.dequantize(v[start : start + n], 1, q.dtype)
            else:
                keys, vals = kv.read(meta.ctx_slots[i, :seq_len], q.dtype)
            qi = q[start : start + n].transpose(0, 1)  # [Hq, n, D]
            out[start : start + n] = causal_attention(
                qi, keys.transpose(0, 1), vals.transpose(0, 1), self.sm_scale
            ).transpose(0, 1)
            start += n
        return out


def causal_attention(
    q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """q [Hq, n, D] are the last n of S positions; keys/vals [Hkv, S, D] -> [Hq, n, D]."""
    n, seq_len = q.shape[1], keys.shape[1]
    # 4-D inputs: SDPA's fused CPU kernel takes only those (3-D falls back to plain math).
    q, keys, vals = q.unsqueeze(0), keys.unsqueeze(0), vals.unsqueeze(0)
    if n == seq_len:  # no cached prefix: the fused causal kernel, no [n, S] mask in memory
        return F.scaled_dot_product_attention(
            q, keys, vals, is_causal=True, scale=sm_scale, enable_gqa=True
        )[0]
    out = torch.empty_like(q)
    # Long extends over a prefix go in query blocks, so the mask stays [block, S].
    for lo in range(0, n, _QUERY_BLOCK):
        hi = min(n, lo + _QUERY_BLOCK)
        # Query j sits at position seq_len - n + j and sees positions up to itself.
        qpos = torch.arange(seq_len - n + lo, seq_len - n + hi, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= qpos[:, None]
        out[:, :, lo:hi] = F.scaled_dot_product_attention(
            q[:, :, lo:hi], keys, vals, attn_mask=mask, scale=sm_scale, enable_gqa=True
        )
    return out[0]


def token_rows_and_positions(inputs: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch row [T] int64 and the position [T] int64 of each new token of a step."""
    dev = inputs.cu_extend.device
    lens = torch.tensor(inputs.extend_lens_host)
    rows = torch.repeat_interleave(torch.arange(len(lens)), lens).to(dev)
    offset = torch.arange(rows.shape[0], device=dev) - inputs.cu_extend[rows]
    return rows, inputs.prefix_lens[rows].long() + offset


def invariant_attention(
    q: torch.Tensor,  # [T, Hq, D]
    kv: _LayerKV,
    ctx_slots: torch.Tensor,  # [B, S] int64 context slots, S whole blocks (padding: finite)
    rows: torch.Tensor,  # [T] int64, each token's request
    pos: torch.Tensor,  # [T] int64, each token's position: it sees positions 0..pos
    sm_scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention whose sums do not depend on the step: keys are folded in blocks of
    `_INVARIANT_KEYS` from position 0 by an online softmax in fp32, each block one batched
    matmul of one shape per (token, KV head), so a token gets the same bits decoded, verified
    or in any prefill chunk, beside any other tokens (blocks past its position weigh 0 and
    leave its sums unchanged)."""
    t, hq, d = q.shape
    b, hkv, kb = ctx_slots.shape[0], kv.k_cache.shape[1], _INVARIANT_KEYS
    qf = q.float().view(t, hkv, hq // hkv, d) * sm_scale  # [T, Hkv, G, D]
    m = torch.full((t, hkv, hq // hkv, 1), float("-inf"), device=q.device)
    denom = torch.zeros_like(m)
    acc = torch.zeros_like(qf)
    for lo in range(0, ctx_slots.shape[1], kb):
        keys, vals = kv.read(ctx_slots[:, lo : lo + kb].reshape(-1), torch.float32)
        # Contiguous: a strided operand lets MKL pick another kernel for some batch sizes.
        keys = keys.view(b, kb, hkv, d)[rows].permute(0, 2, 3, 1).contiguous()  # [T, Hkv, D, kb]
        vals = vals.view(b, kb, hkv, d)[rows].transpose(1, 2).contiguous()  # [T, Hkv, kb, D]
        hidden = torch.arange(lo, lo + kb, device=q.device)[None, :] > pos[:, None]  # [T, kb]
        scores = torch.matmul(qf, keys).masked_fill(hidden[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
        alpha, p = torch.exp(m - m_new), torch.exp(scores - m_new)
        denom = denom * alpha + p.sum(dim=-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, vals)
        m = m_new
    return (acc / denom).view(t, hq, d).to(q.dtype)
