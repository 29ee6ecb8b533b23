"""Triton attention kernels against the torch reference.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set here before
the kernel modules are imported), so sizes stay small; with CUDA the same cases run natively.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed (optional dependency 'gpu')")

from minisgl.kernels.attention import reference as ref  # noqa: E402
from minisgl.kernels.attention.decode import (
    DecodeConfig,
    _decode_split_kernel,
    choose_num_splits,
    decode_attention,
    default_decode_config,
)
from minisgl.kernels.attention.extend import ExtendConfig, extend_attention  # noqa: E402
from minisgl.kernels.attention.store import store_kv  # noqa: E402
from minisgl.kernels.attention.testing import cu_seqlens, random_paged_kv  # noqa: E402
from minisgl.kernels.common import is_interpreted, split_counters  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not is_interpreted(_decode_split_kernel):
    pytest.skip(
        "minisgl.kernels was imported before TRITON_INTERPRET=1 was set; "
        "run with TRITON_INTERPRET=1 in the environment",
        allow_module_level=True,
    )

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
SMALL_EXTEND = ExtendConfig(block_m=16, block_n=16, num_warps=4)
SMALL_DECODE = DecodeConfig(block_n=16, block_n_unsplit=16)


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "output has NaN/Inf (unwritten or read outside a context)"
    return ((out.float() - expected).abs().max() / expected.abs().max().clamp_min(1e-6)).item()


def nan_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))


def strided_q(num_rows: int, num_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Query rows as a view of a fused qkv buffer, like a model's projection output."""
    qkv = torch.randn(num_rows, num_heads + 2, head_dim, dtype=dtype, device=DEVICE)
    return qkv[:, :num_heads]


# (dtype, page_size, head_dim, q heads, kv heads, num_splits, seq_lens)
DECODE_CASES = [
    (torch.float32, 1, 64, 4, 4, 1, [37, 1, 70]),
    (torch.float32, 16, 128, 9, 3, 3, [33, 16, 75]),
    (torch.float32, 16, 64, 8, 2, 4, [100, 17]),
    (torch.float32, 1, 128, 16, 2, None, [50, 3, 64]),
    (torch.bfloat16, 16, 128, 8, 2, 1, [48, 31]),
    (torch.bfloat16, 1, 64, 9, 3, 2, [2, 61, 40]),
    (torch.bfloat16, 16, 64, 4, 4, 5, [90, 1, 20]),
    (torch.float16, 16, 128, 16, 2, 3, [77, 5]),
]


@pytest.mark.parametrize("dtype,page_size,head_dim,hq,hkv,num_splits,lens", DECODE_CASES)
def test_decode_matches_reference(
    dtype: torch.dtype,
    page_size: int,
    head_dim: int,
    hq: int,
    hkv: int,
    num_splits: int | None,
    lens: list[int],
) -> None:
    torch.manual_seed(hash((page_size, head_dim, hq, len(lens))) % 2**31)
    kv = random_paged_kv(lens, page_size, hkv, head_dim, dtype, DEVICE)
    q = strided_q(len(lens), hq, head_dim, dtype)
    scale = head_dim**-0.5
    out = nan_like(q)
    decode_attention(
        q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, page_size, scale,
        num_splits=num_splits, max_seq_len=kv.max_seq_len, config=SMALL_DECODE, out=out,
    )  # fmt: skip
    expected = ref.decode_attention_ref(
        q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, page_size, scale
    )
    assert rel_err(out, expected) <= TOL[dtype]
    # The splits' completion counters are back at zero for the next launch.
    assert not split_counters(q.device, len(lens) * hkv).any()


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_empty_request_gives_zeros(num_splits: int) -> None:
    kv = random_paged_kv([0, 20], 16, 2, 64, torch.float32, DEVICE)
    q = torch.randn(2, 4, 64, device=DEVICE)
    out = decode_attention(
        q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, 16, 0.125,
        num_splits=num_splits, config=SMALL_DECODE,
    )  # fmt: skip
    expected = ref.decode_attention_ref(
        q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, 16, 0.125
    )
    assert (out[0] == 0).all()
    assert rel_err(out, expected) <= 1e-4


def test_decode_default_config() -> None:
    """The production tile sizes (BLOCK_N 64 for head_dim 128), a split ending mid-block."""
    torch.manual_seed(1)
    lens = [130, 7]
    kv = random_paged_kv(lens, 16, 2, 128, torch.float32, DEVICE)
    q = torch.randn(2, 4, 128, device=DEVICE)
    out = decode_attention(
        q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, 16, 0.09, num_splits=2
    )
    expected = ref.decode_attention_ref(
        q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, 16, 0.09
    )
    assert rel_err(out, expected) <= 1e-4


def test_choose_num_splits() -> None:
    cfg = DecodeConfig(programs_per_sm=4, min_split_tokens=256, max_splits=64)
    assert choose_num_splits(256, 8, 4096, 132, cfg) == 1  # batch alone fills the GPU
    assert choose_num_splits(32, 8, 4096, 132, cfg) == 2
    assert choose_num_splits(1, 8, 32768, 132, cfg) == 64  # capped
    assert choose_num_splits(1, 8, 512, 132, cfg) == 2  # short context: few splits
    assert choose_num_splits(1, 8, 1, 132, cfg) == 1


# (dtype, page_size, head_dim, q heads, kv heads, extend_lens, prefix_lens)
EXTEND_CASES = [
    (torch.float32, 1, 64, 4, 4, [20, 33], [0, 0]),
    (torch.float32, 16, 128, 9, 3, [18, 5], [21, 40]),
    (torch.float32, 16, 64, 8, 2, [1, 40, 9], [30, 0, 16]),
    (torch.bfloat16, 16, 128, 8, 1, [24], [19]),
    (torch.bfloat16, 1, 64, 9, 3, [35, 1], [0, 12]),
    (torch.float16, 16, 64, 16, 2, [17, 6], [3, 0]),
]


@pytest.mark.parametrize("dtype,page_size,head_dim,hq,hkv,ext_lens,prefix_lens", EXTEND_CASES)
def test_extend_matches_reference(
    dtype: torch.dtype,
    page_size: int,
    head_dim: int,
    hq: int,
    hkv: int,
    ext_lens: list[int],
    prefix_lens: list[int],
) -> None:
    run_extend_case(dtype, page_size, head_dim, hq, hkv, ext_lens, prefix_lens, SMALL_EXTEND)


def run_extend_case(
    dtype: torch.dtype,
    page_size: int,
    head_dim: int,
    hq: int,
    hkv: int,
    ext_lens: list[int],
    prefix_lens: list[int],
    config: ExtendConfig | None,
) -> None:
    torch.manual_seed(hash((page_size, head_dim, hq, len(ext_lens))) % 2**31)
    seq_lens = [p + e for p, e in zip(prefix_lens, ext_lens, strict=True)]
    kv = random_paged_kv(seq_lens, page_size, hkv, head_dim, dtype, DEVICE)
    ext = torch.tensor(ext_lens, dtype=torch.int32, device=DEVICE)
    cu = cu_seqlens(ext_lens, DEVICE)
    q = strided_q(sum(ext_lens), hq, head_dim, dtype)
    scale = head_dim**-0.5
    out = nan_like(q)
    extend_attention(
        q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, ext, cu, page_size, scale,
        max(ext_lens), config=config, out=out,
    )  # fmt: skip
    expected = ref.extend_attention_ref(
        q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, ext, cu, page_size, scale
    )
    assert rel_err(out, expected) <= TOL[dtype]


def test_extend_after_store_matches_decode() -> None:
    """store_kv then extend over a prefix; the last new token's row equals decode at that length."""
    torch.manual_seed(2)
    page_size, hq, hkv, d = 16, 6, 2, 64
    prefix, new = [23, 0], [9, 14]
    seq = [p + n for p, n in zip(prefix, new, strict=True)]
    kv = random_paged_kv(seq, page_size, hkv, d, torch.float32, DEVICE)
    loc = torch.cat([
        ref.context_slots(kv.block_table[i], s, page_size)[p:]
        for i, (p, s) in enumerate(zip(prefix, seq, strict=True))
    ])  # fmt: skip
    k_new = torch.randn(sum(new), hkv, d, device=DEVICE)
    v_new = torch.randn(sum(new), hkv, d, device=DEVICE)
    store_kv(kv.k_cache, kv.v_cache, loc, k_new, v_new)
    q = torch.randn(sum(new), hq, d, device=DEVICE)
    ext, cu = torch.tensor(new, dtype=torch.int32, device=DEVICE), cu_seqlens(new, DEVICE)
    out = extend_attention(
        q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, ext, cu, page_size, 0.125,
        max(new), config=SMALL_EXTEND,
    )  # fmt: skip
    last = cu[1:].long() - 1
    dec = decode_attention(
        q[last].contiguous(), kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, page_size,
        0.125, num_splits=2, config=SMALL_DECODE,
    )  # fmt: skip
    assert rel_err(out[last], dec.float()) <= 1e-4


# FP8 (e4m3) pools: the kernels widen the stored bytes in registers and apply the per-head
# scales; the reference dequantizes the same bytes in fp32. What differs is only how each side
# rounds its own arithmetic (fp16 probabilities and operands in the kernel, the output cast),
# so the FP8 cases keep the 16-bit tolerances; e4m3's own rounding is the same on both sides.
# V lies in the FP8 pool's layout, pages [Hkv, D, page_size] (`random_paged_kv`), whose context
# pages end in 448s: a kernel that weighs a slot past the context fails loudly. The last two run the FP8 default tiles (`default_decode_config(head_dim, kv_fp8=True)`: 128
# keys at head_dim 128, 256 at 64; its warps and stages matter only to the GPU compiler).
FP8_DECODE_CASES = [
    (torch.float32, 16, 128, 8, 2, 3, [77, 5], SMALL_DECODE),
    (torch.float32, 1, 64, 9, 3, 1, [37, 1, 70], SMALL_DECODE),
    (torch.bfloat16, 16, 64, 4, 4, 2, [90, 1, 20], SMALL_DECODE),
    (torch.float16, 16, 128, 16, 2, 1, [48, 31], SMALL_DECODE),
    (torch.bfloat16, 24, 64, 4, 2, 2, [100, 47], SMALL_DECODE),  # pages of 24: runs of 8 keys
    (torch.bfloat16, 32, 128, 4, 2, 1, [300, 9], default_decode_config(128, kv_fp8=True)),
    (torch.float32, 16, 64, 6, 2, 2, [600, 1, 40], default_decode_config(64, kv_fp8=True)),
]


@pytest.mark.parametrize("dtype,page_size,head_dim,hq,hkv,num_splits,lens,config", FP8_DECODE_CASES)
def test_decode_fp8_kv_matches_reference(
    dtype: torch.dtype,
    page_size: int,
    head_dim: int,
    hq: int,
    hkv: int,
    num_splits: int,
    lens: list[int],
    config: DecodeConfig,
) -> None:
    torch.manual_seed(hash(("fp8", page_size, head_dim, hq)) % 2**31)
    kv = random_paged_kv(lens, page_size, hkv, head_dim, torch.float8_e4m3fn, DEVICE)
    q = strided_q(len(lens), hq, head_dim, dtype)
    out = nan_like(q)
    decode_attention(
        q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, page_size, head_dim**-0.5,
        num_splits=num_splits, config=config, out=out, kv_scales=kv.kv_scales,
    )  # fmt: skip
    expected = ref.decode_attention_ref(
        q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, page_size, head_dim**-0.5,
        kv.kv_scales,
    )  # fmt: skip
    assert rel_err(out, expected) <= TOL[dtype]


@pytest.mark.parametrize(
    "dtype,page_size,head_dim,hq,hkv,ext_lens,prefix_lens",
    [
        (torch.float32, 16, 64, 8, 2, [1, 40, 9], [30, 0, 16]),
        (torch.bfloat16, 1, 64, 9, 3, [35, 1], [0, 12]),
        (torch.float16, 16, 128, 8, 1, [24], [19]),
    ],
)
def test_extend_fp8_kv_matches_reference(
    dtype: torch.dtype,
    page_size: int,
    head_dim: int,
    hq: int,
    hkv: int,
    ext_lens: list[int],
    prefix_lens: list[int],
) -> None:
    torch.manual_seed(hash(("fp8", page_size, head_dim, hq, len(ext_lens))) % 2**31)
    seq_lens = [p + e for p, e in zip(prefix_lens, ext_lens, strict=True)]
    kv = random_paged_kv(seq_lens, page_size, hkv, head_dim, torch.float8_e4m3fn, DEVICE)
    ext = torch.tensor(ext_lens, dtype=torch.int32, device=DEVICE)
    cu = cu_seqlens(ext_lens, DEVICE)
    q = strided_q(sum(ext_lens), hq, head_dim, dtype)
    out = nan_like(q)
    args = (kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, ext, cu, page_size, 0.125)
    extend_attention(q, *args, max(ext_lens), config=SMALL_EXTEND, out=out, kv_scales=kv.kv_scales)
    expected = ref.extend_attention_ref(q, *args, kv.kv_scales)
    assert rel_err(out, expected) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_fp8(dtype: torch.dtype) -> None:
    """The kernel writes `quantize_kv`'s bytes: (k - shift) / scale and v / scale of its head,
    saturated at +-448; V into the FP8 pool's pages [Hkv, D, page_size]."""
    from minisgl.kernels.fp8 import quantize_kv, v_pages, v_rows

    torch.manual_seed(7)
    slots, t, hkv, d = 64, 10, 3, 32
    k_cache = torch.zeros(slots, hkv, d, dtype=torch.float8_e4m3fn, device=DEVICE)
    v_cache = v_pages(torch.zeros_like(k_cache), 16)
    loc = torch.randperm(slots, device=DEVICE)[:t]
    kv = (torch.randn(t, 2 * hkv + 4, d, device=DEVICE) * 30).to(dtype)  # strided views
    k, v = kv[:, :hkv], kv[:, hkv : 2 * hkv]
    scales = (torch.tensor([0.01, 0.1, 1.0], device=DEVICE),) * 2
    shift = torch.randn(hkv, d, device=DEVICE) * 5
    store_kv(k_cache, v_cache, loc, k, v, scales, shift)
    assert torch.equal(k_cache[loc].float(), quantize_kv(k, scales[0], shift).float())
    assert torch.equal(v_rows(v_cache, loc).float(), quantize_kv(v, scales[1]).float())
    assert k_cache[loc].float().abs().max() == 448  # saturated, not NaN
    untouched = torch.ones(slots, dtype=torch.bool, device=DEVICE)
    untouched[loc] = False
    assert not k_cache[untouched].float().any()
    assert v_cache.float().count_nonzero() == v_rows(v_cache, loc).float().count_nonzero()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    slots, t, hkv, d = 64, 10, 3, 32
    k_cache = torch.randn(slots, hkv, d, dtype=dtype, device=DEVICE)
    v_cache = torch.randn(slots, hkv, d, dtype=dtype, device=DEVICE)
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    loc = torch.randperm(slots, device=DEVICE)[:t]
    kv = torch.randn(t, 2 * hkv + 4, d, dtype=dtype, device=DEVICE)  # strided views
    k, v = kv[:, :hkv], kv[:, hkv : 2 * hkv]
    store_kv(k_cache, v_cache, loc, k, v)
    ref.store_kv_ref(k_exp, v_exp, loc, k, v)
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)


def test_rejects_unsupported_head_dim() -> None:
    kv = random_paged_kv([4], 1, 1, 48, torch.float32, DEVICE)
    q = torch.randn(1, 1, 48, device=DEVICE)
    with pytest.raises(ValueError, match="power of two"):
        decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, 1, 1.0)


def test_rejects_tiles_tl_dot_cannot_use() -> None:
    with pytest.raises(ValueError, match="block_n"):
        DecodeConfig(block_n=8)
    with pytest.raises(ValueError, match="block_m"):
        ExtendConfig(block_m=48)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_larger(dtype: torch.dtype) -> None:
    lens = [300, 1, 129, 257]
    torch.manual_seed(4)
    kv = random_paged_kv(lens, 16, 2, 128, dtype, DEVICE)
    q = torch.randn(len(lens), 8, 128, dtype=dtype, device=DEVICE)
    out = nan_like(q)
    decode_attention(
        q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, 16, 0.088, num_splits=3, out=out
    )
    expected = ref.decode_attention_ref(
        q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, 16, 0.088
    )
    assert rel_err(out, expected) <= TOL[dtype]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_larger_default_config(dtype: torch.dtype) -> None:
    run_extend_case(dtype, 16, 128, 4, 2, [150, 70], [100, 0], None)
