"""The torch attention backend (the CPU path) against attention written out per request, and
the CPU layer shortcuts (column-major weights, one-op RMSNorm, the rotation) against the
reference formulas they replace, bit for bit in fp32."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from minisgl.attention.base import AttentionInputs
from minisgl.attention.torch_backend import TorchBackend, plan_groups
from minisgl.config import RopeConfig
from minisgl.core import TableWrite
from minisgl.kvcache import KVPool, ReqTable
from minisgl.layers import MergedColumnParallelLinear, QKVParallelLinear, RMSNorm, RowParallelLinear
from minisgl.layers.rotary import RotaryEmbedding

HQ, HKV, D = 6, 2, 16


def _setup(page_size: int, seq_lens: list[int], seed: int) -> tuple[TorchBackend, list[list[int]]]:
    """A pool with random K/V and requests whose pages are scattered over it."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // page_size) for n in seq_lens) + 3
    pool = KVPool(2, num_pages, page_size, HKV, D, torch.float32, torch.device("cpu"))
    for layer in range(2):
        pool.k(layer).copy_(torch.randn(pool.k(layer).shape, generator=gen))
        pool.v(layer).copy_(torch.randn(pool.v(layer).shape, generator=gen))
    table = ReqTable(len(seq_lens) + 1, 256, page_size, torch.device("cpu"))
    free = list(range(num_pages))
    random.Random(seed).shuffle(free)
    slots_of = []
    for slot, n in enumerate(seq_lens):
        pages = [free.pop() for _ in range(-(-n // page_size))]
        table.apply([TableWrite(slot, 0, pages)], [])
        slots_of.append([pages[p // page_size] * page_size + p % page_size for p in range(n)])
    return TorchBackend(pool, table, HQ, D**-0.5), slots_of


def _inputs(seq_lens: list[int], ext_lens: list[int], slots_of: list[list[int]]) -> AttentionInputs:
    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int32)

    cu = [0]
    for e in ext_lens:
        cu.append(cu[-1] + e)
    out_loc = [s for n, e, sl in zip(seq_lens, ext_lens, slots_of) for s in sl[n - e : n]]
    return AttentionInputs(
        req_slots=torch.arange(len(seq_lens)),
        seq_lens=t(seq_lens),
        prefix_lens=t([n - e for n, e in zip(seq_lens, ext_lens)]),
        extend_lens=t(ext_lens),
        cu_extend=t(cu),
        out_loc=torch.tensor(out_loc, dtype=torch.int64),
        is_decode=all(e == 1 for e in ext_lens),
        seq_lens_host=seq_lens,
        extend_lens_host=ext_lens,
    )


def _reference(q, k_cache, v_cache, seq_lens, ext_lens, slots_of) -> torch.Tensor:
    """Plain softmax(q k^T) v per request and query head, causal over the new tokens."""
    out, row = [], 0
    for n, e, slots in zip(seq_lens, ext_lens, slots_of):
        keys, vals = k_cache[slots], v_cache[slots]  # [n, Hkv, D]
        for j in range(e):
            pos = n - e + j
            heads = []
            for h in range(HQ):
                kv = h // (HQ // HKV)
                s = keys[: pos + 1, kv] @ q[row + j, h] / math.sqrt(D)
                heads.append(torch.softmax(s, 0) @ vals[: pos + 1, kv])
            out.append(torch.stack(heads))
        row += e
    return torch.stack(out)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(
    "seq_lens",
    [[7], [5, 5, 5], [3, 40, 41, 90, 12, 88, 200, 9]],
    ids=["one", "equal", "spread"],
)
def test_decode_matches_reference(page_size, seq_lens):
    backend, slots_of = _setup(page_size, seq_lens, seed=len(seq_lens) + page_size)
    inputs = _inputs(seq_lens, [1] * len(seq_lens), slots_of)
    meta = backend.prepare(inputs)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(seq_lens), HQ, D, generator=gen)
    k = torch.randn(len(seq_lens), HKV, D, generator=gen)
    v = torch.randn(len(seq_lens), HKV, D, generator=gen)
    out = backend.forward(q, k, v, 1, meta)
    pool = backend.pool
    want = _reference(q, pool.k(1), pool.v(1), seq_lens, [1] * len(seq_lens), slots_of)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    if len(set(seq_lens)) > 2:
        assert len(meta.groups) > 1  # the spread batch is split by length


@pytest.mark.parametrize("page_size", [1, 4])
def test_extend_with_and_without_prefix(page_size):
    seq_lens, ext_lens = [9, 30, 17, 1], [9, 6, 1, 1]  # fresh prompt, chunk, decode, first token
    backend, slots_of = _setup(page_size, seq_lens, seed=3)
    inputs = _inputs(seq_lens, ext_lens, slots_of)
    meta = backend.prepare(inputs)
    gen = torch.Generator().manual_seed(2)
    t = sum(ext_lens)
    q = torch.randn(t, HQ, D, generator=gen)
    k = torch.randn(t, HKV, D, generator=gen)
    v = torch.randn(t, HKV, D, generator=gen)
    out = backend.forward(q, k, v, 0, meta)
    pool = backend.pool
    want = _reference(q, pool.k(0), pool.v(0), seq_lens, ext_lens, slots_of)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_plan_groups_covers_every_row_once():
    rng = random.Random(0)
    for _ in range(50):
        lens = [rng.randint(1, 3000) for _ in range(rng.randint(1, 300))]
        groups = plan_groups(lens, 64)
        assert sorted(i for g in groups for i in g) == list(range(len(lens)))
        padded = sum(len(g) * max(lens[i] for i in g) for g in groups) + 64 * len(groups)
        assert padded <= len(lens) * max(lens) + 64  # never worse than one group
    assert plan_groups([5, 5, 5], 64) == [[0, 1, 2]]
    assert plan_groups([1, 1000], 64) == [[0], [1]]
    assert plan_groups([10, 11], 64) == [[0, 1]]


def test_cpu_weights_are_column_major_and_load_like_row_major():
    torch.manual_seed(0)
    qkv = QKVParallelLinear(32, 8, 4, 2)
    gate_up = MergedColumnParallelLinear(32, [48, 48])
    down = RowParallelLinear(48, 32)
    full = {"q": torch.randn(32, 32), "k": torch.randn(16, 32), "v": torch.randn(16, 32)}
    for sid, w in full.items():
        qkv.weight.weight_loader(qkv.weight, w, sid)  # type: ignore[attr-defined]
    parts = [torch.randn(48, 32), torch.randn(48, 32)]
    for i, w in enumerate(parts):
        gate_up.weight.weight_loader(gate_up.weight, w, i)  # type: ignore[attr-defined]
    w_down = torch.randn(32, 48)
    down.weight.weight_loader(down.weight, w_down)  # type: ignore[attr-defined]
    for layer in (qkv, gate_up, down):
        assert layer.weight.t().is_contiguous()
    assert torch.equal(qkv.weight, torch.cat([full["q"], full["k"], full["v"]]))
    assert torch.equal(gate_up.weight, torch.cat(parts))
    x = torch.randn(40, 48)
    assert torch.equal(down(x), F.linear(x, w_down))


def test_rms_norm_and_rotation_match_reference_formulas():
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data.copy_(torch.randn(64))
    x, res = torch.randn(33, 64) * 3, torch.randn(33, 64)
    h = x + res
    want = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
    got, new_res = norm(x, res)
    assert torch.equal(got, want) and torch.equal(new_res, h)

    rope = RotaryEmbedding(64, 512, RopeConfig())
    pos = torch.randint(0, 512, (33,))
    q, k = torch.randn(33, 6, 64), torch.randn(33, 2, 64)
    cos, sin = rope.cos_sin[pos].unsqueeze(1).chunk(2, dim=-1)  # type: ignore[index]

    def ref(t: torch.Tensor) -> torch.Tensor:
        t1, t2 = t.chunk(2, dim=-1)
        return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], dim=-1)

    for rows in (None, rope.lookup(pos)):
        rq, rk = rope(pos, q, k, rows=rows)
        assert torch.equal(rq, ref(q)) and torch.equal(rk, ref(k))
