"""Triton attention kernels against the torch reference on CUDA, at serving sizes.

Contexts up to 32k, batches up to 256, page sizes 1/16/64, bf16 mostly. Pools are poisoned
(NaN outside every context) and outputs pre-filled with NaN, so stray reads and unwritten rows
show up as NaN. The reference is slow, so large batches are checked on a spread of requests.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton", reason="Triton is not installed (optional dependency 'gpu')")

from minisgl.kernels.attention import reference as ref  # noqa: E402
from minisgl.kernels.attention.decode import decode_attention  # noqa: E402
from minisgl.kernels.attention.extend import extend_attention  # noqa: E402
from minisgl.kernels.attention.store import store_kv  # noqa: E402
from minisgl.kernels.attention.testing import PagedKV, cu_seqlens, random_paged_kv  # noqa: E402

DEVICE = "cuda"
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
CHECKED_REQUESTS = 12


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "output has NaN/Inf (unwritten or read outside a context)"
    return ((out.float() - expected).abs().max() / expected.abs().max().clamp_min(1e-6)).item()


def spread(n: int, k: int = CHECKED_REQUESTS) -> list[int]:
    """Up to k indices spread over range(n), first and last included."""
    return sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(min(n, k))})


def run_decode(
    kv: PagedKV, hq: int, num_splits: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel output for every request and the reference for a spread of them."""
    _, hkv, d = kv.k_cache.shape
    q = torch.randn(len(kv.seq_lens_host), hq, d, dtype=kv.k_cache.dtype, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    decode_attention(
        q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, kv.page_size, d**-0.5,
        num_splits=num_splits, max_seq_len=kv.max_seq_len, out=out,
    )  # fmt: skip
    idx = torch.tensor(spread(q.shape[0]), device=DEVICE)
    expected = ref.decode_attention_ref(
        q[idx], kv.k_cache, kv.v_cache, kv.block_table[idx], kv.seq_lens[idx], kv.page_size,
        d**-0.5,
    )  # fmt: skip
    assert torch.isfinite(out).all()
    return out[idx], expected


# (batch, max context, page size, q heads, kv heads, head_dim, dtype)
DECODE_CASES = [
    (256, 4096, 1, 16, 8, 128, torch.bfloat16),
    (256, 4096, 16, 16, 8, 128, torch.bfloat16),
    (256, 4096, 64, 16, 8, 128, torch.bfloat16),
    (32, 16384, 16, 32, 8, 128, torch.bfloat16),
    (1, 32768, 1, 16, 8, 128, torch.bfloat16),
    (1, 32768, 64, 32, 8, 128, torch.bfloat16),
    (8, 32768, 16, 16, 8, 128, torch.bfloat16),
    (64, 2048, 16, 12, 4, 64, torch.bfloat16),
    (16, 4096, 32, 8, 1, 256, torch.bfloat16),
    (48, 3000, 16, 9, 3, 128, torch.float16),
    (16, 5000, 16, 16, 8, 128, torch.float32),
    (8, 1500, 1, 14, 2, 64, torch.float32),
]


@pytest.mark.parametrize("batch,max_ctx,page_size,hq,hkv,d,dtype", DECODE_CASES)
def test_decode(
    batch: int, max_ctx: int, page_size: int, hq: int, hkv: int, d: int, dtype: torch.dtype
) -> None:
    rng = random.Random(batch * 7 + page_size)
    lens = [rng.randint(1, max_ctx) for _ in range(batch)]
    lens[0] = max_ctx  # one request at the full context
    torch.manual_seed(0)
    kv = random_paged_kv(lens, page_size, hkv, d, dtype, DEVICE)
    out, expected = run_decode(kv, hq)
    assert rel_err(out, expected) <= TOL[dtype]


@pytest.mark.parametrize("num_splits", [1, 2, 7, 64])
def test_decode_any_num_splits(num_splits: int) -> None:
    """Splits are per-request fractions: every count gives the same answer, short requests too."""
    torch.manual_seed(1)
    lens = [1, 5, 63, 64, 65, 1000, 8191, 20000]
    kv = random_paged_kv(lens, 16, 8, 128, torch.bfloat16, DEVICE)
    out, expected = run_decode(kv, 16, num_splits=num_splits)
    assert rel_err(out, expected) <= 1e-2


def test_decode_in_cuda_graph() -> None:
    """Captured once, replayed as the contexts grow: no host syncs, splits follow the lengths."""
    torch.manual_seed(2)
    batch, hq, hkv, d, page_size = 32, 16, 8, 128, 16
    final = [random.Random(i).randint(100, 6000) for i in range(batch)]
    kv = random_paged_kv(final, page_size, hkv, d, torch.bfloat16, DEVICE)
    lens = kv.seq_lens.clone()
    q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device=DEVICE)
    out = torch.empty_like(q)
    lens.copy_(kv.seq_lens // 3 + 1)

    def step() -> None:
        decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, lens, page_size, d**-0.5,
                         num_splits=4, out=out)  # fmt: skip

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for new_lens in (kv.seq_lens // 2, kv.seq_lens):
        lens.copy_(new_lens)
        graph.replay()
        expected = ref.decode_attention_ref(
            q, kv.k_cache, kv.v_cache, kv.block_table, lens, page_size, d**-0.5
        )
        assert rel_err(out, expected) <= 1e-2


def run_extend(
    ext_lens: list[int],
    prefix_lens: list[int],
    page_size: int,
    hq: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
) -> float:
    seq = [p + e for p, e in zip(prefix_lens, ext_lens, strict=True)]
    kv = random_paged_kv(seq, page_size, hkv, d, dtype, DEVICE)
    ext = torch.tensor(ext_lens, dtype=torch.int32, device=DEVICE)
    cu = cu_seqlens(ext_lens, DEVICE)
    q = torch.randn(sum(ext_lens), hq, d, dtype=dtype, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    extend_attention(
        q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, ext, cu, page_size, d**-0.5,
        max(ext_lens), out=out,
    )  # fmt: skip
    assert torch.isfinite(out).all()
    n = min(len(ext_lens), 4)  # the reference on the first few requests only
    rows = int(cu[n])
    expected = ref.extend_attention_ref(
        q[:rows], kv.k_cache, kv.v_cache, kv.block_table[:n], kv.seq_lens[:n], ext[:n],
        cu[: n + 1], page_size, d**-0.5,
    )  # fmt: skip
    return rel_err(out[:rows], expected)


# (extend lens, prefix lens, page size, q heads, kv heads, head_dim, dtype)
EXTEND_CASES = [
    ([8192], [0], 16, 16, 8, 128, torch.bfloat16),
    ([1024] * 16, [2048] * 16, 16, 16, 8, 128, torch.bfloat16),
    ([1024] * 16, [2048] * 16, 1, 16, 8, 128, torch.bfloat16),
    ([1000, 1, 77, 3000], [0, 4095, 2049, 17], 64, 32, 8, 128, torch.bfloat16),
    ([513, 64, 2000], [31, 0, 999], 16, 12, 4, 64, torch.bfloat16),
    ([300, 700], [100, 1500], 32, 8, 1, 256, torch.bfloat16),
    ([2048, 33], [1000, 0], 16, 9, 3, 128, torch.float16),
    ([1500, 129], [511, 2], 16, 16, 8, 128, torch.float32),
]


@pytest.mark.parametrize("ext_lens,prefix_lens,page_size,hq,hkv,d,dtype", EXTEND_CASES)
def test_extend(
    ext_lens: list[int],
    prefix_lens: list[int],
    page_size: int,
    hq: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
) -> None:
    torch.manual_seed(3)
    assert run_extend(ext_lens, prefix_lens, page_size, hq, hkv, d, dtype) <= TOL[dtype]


def test_store_kv_large() -> None:
    torch.manual_seed(4)
    slots, t, hkv, d = 1 << 16, 8192, 8, 128
    k_cache = torch.randn(slots, hkv, d, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    loc = torch.randperm(slots, device=DEVICE)[:t]
    qkv = torch.randn(t, 32, d, dtype=torch.bfloat16, device=DEVICE)
    k, v = qkv[:, 16:24], qkv[:, 24:32]
    store_kv(k_cache, v_cache, loc, k, v)
    ref.store_kv_ref(k_exp, v_exp, loc, k, v)
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)
