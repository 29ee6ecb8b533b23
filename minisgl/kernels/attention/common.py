"""Triton building blocks of the paged attention kernels (imports Triton): argument checks, the
tile loads of K/V through the block table (16-bit rows or an FP8 pool's transposed V pages), the
online softmax step and the combine of flash-decoding splits."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.common import dot, dot_flags, pdl_args, round_bf16, round_e4m3


def check_paged_args(
    q: torch.Tensor,  # [rows, Hq, D]
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [B, P] int32
    seq_lens: torch.Tensor,  # [B] int32
    cu_extend: torch.Tensor | None = None,  # [B + 1] int32
    extend_lens: torch.Tensor | None = None,  # [B] int32
) -> None:
    """What the paged attention kernels assume of their tensors (shapes, dtypes, strides)."""
    batch = seq_lens.shape[0]
    for t, n in ((seq_lens, batch), (cu_extend, batch + 1), (extend_lens, batch)):
        assert t is None or (t.dtype == torch.int32 and t.shape == (n,) and t.is_contiguous())
    _, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(
            f"head_dim {head_dim} is not supported by the Triton attention kernels: "
            "use a power of two between 16 and 256"
        )
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    assert k_cache.shape[2] == head_dim
    v_page_size(k_cache, v_cache)
    assert block_table.dtype == torch.int32 and block_table.shape[0] == batch
    for t in (q, k_cache, v_cache):
        assert t.stride(-1) == 1, "head_dim must be contiguous"
    assert block_table.stride(1) == 1


def paged_launch(
    kernel: object,
    q: torch.Tensor,  # [rows, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
    out: torch.Tensor | None,
    cu_extend: torch.Tensor | None = None,
    extend_lens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], tuple[int, ...], dict[str, bool]]:
    """What every paged attention launch shares, its arguments checked (`check_paged_args`):
    (the output: `out` or a new tensor like q; K's and V's scales (`seq_lens`, never read, for
    a 16-bit cache); the nine strides in the kernels' order (q's token and head, K's, V's, the
    block table's row, out's token and head); the KV_FP8, IEEE, EMULATE_BF16 and PDL flags)."""
    check_paged_args(q, k_cache, v_cache, block_table, seq_lens, cu_extend, extend_lens)
    fp8 = check_kv_scales(k_cache, kv_scales, k_cache.shape[1])
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    scales = kv_scales if kv_scales is not None else (seq_lens, seq_lens)
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
               v_cache.stride(1), block_table.stride(0), out.stride(0), out.stride(1))  # fmt: skip
    ieee, emulate_bf16 = dot_flags(q.dtype, kernel, fp8)
    flags = dict(KV_FP8=fp8, IEEE=ieee, EMULATE_BF16=emulate_bf16, **pdl_args(q.device))
    return out, scales, strides, flags


def check_tile_sizes(config: object, *names: str) -> None:
    """Tile sizes of an attention config: powers of two >= 16 (tl.dot)."""
    for name in names:
        size = getattr(config, name)
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot), got {size}")


def v_page_size(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Checks a pool layer's K [slots, Hkv, D] against its V: the same shape, or an FP8 pool's
    [pages, Hkv, D, page_size] (`KVPool`), whose page size it returns (1 otherwise)."""
    if k_cache.dtype != torch.float8_e4m3fn:
        assert k_cache.shape == v_cache.shape
        return 1
    pages, hkv, d, ps = v_cache.shape
    assert (pages * ps, hkv, d) == k_cache.shape and v_cache.is_contiguous()
    return ps


def check_kv_scales(
    k_cache: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None, num_kv_heads: int
) -> bool:
    """True for an FP8 cache, which must come with its per-head scales."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    assert fp8 == (scales is not None), "an FP8 KV cache needs its scales (and only it)"
    if scales is not None:
        for s in scales:
            assert s.shape == (num_kv_heads,) and s.dtype == torch.float32 and s.is_contiguous()
    return fp8


def store_args(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None,
    k_shift: torch.Tensor | None,
    unread: torch.Tensor,
) -> tuple[int, bool, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(V's page size, whether the cache is FP8, K's and V's scales, the [Hkv, D] fp32 key shift
    (zeros when none is given)) of a store into a pool layer; `unread` for what a 16-bit cache
    does not read."""
    page_size = v_page_size(k_cache, v_cache)
    if not check_kv_scales(k_cache, scales, k_cache.shape[1]):
        return page_size, False, unread, unread, unread
    assert scales is not None
    if k_shift is None:
        k_shift = torch.zeros(k_cache.shape[1:], dtype=torch.float32, device=k_cache.device)
    assert k_shift.shape == k_cache.shape[1:] and k_shift.dtype == torch.float32
    assert k_shift.is_contiguous()
    return page_size, True, scales[0], scales[1], k_shift


@triton.jit
def quantize_fp8(x, scale, shift, EMULATE_FP8: tl.constexpr):
    """(x [H, D] - shift [H, D] or 0) / scale [H] in fp32, clamped to e4m3's +-448 (a store then
    rounds it to e4m3): `minisgl.kernels.fp8.quantize_kv`. EMULATE_FP8 (the CPU interpreter,
    whose fp32 -> e4m3 cast rounds wrongly: 127.99 becomes 64): round to the e4m3 grid here, so
    the cast only sees values it can represent."""
    # IEEE division (Triton's `/` may be approximate): the same e4m3 as the torch reference.
    y = tl.math.div_rn(x.to(tl.float32) - shift, scale[:, None] + tl.zeros_like(x.to(tl.float32)))
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if EMULATE_FP8:
        y = round_e4m3(y)
    return y


@triton.jit
def fp8_operand(x, q):
    """`x` (an FP8 K/V tile, or q itself) widened for the dots with the query `q`: to fp16 for a
    16-bit q (every e4m3 value is exact in fp16, and the conversion is one instruction per two
    values; a bf16 q converts exactly unless it lies beyond fp16's 65504), to fp32 for fp32."""
    if q.dtype == tl.float32:
        out = x.to(tl.float32)
    else:
        out = x.to(tl.float16)
    return out


@triton.jit
def load_v_block(
    v_head_ptr,  # V of this program's KV head: v_ptr + kv_head * (V's head stride)
    slots,  # [BLOCK_N] int64 slots of positions `pos` (clamped into the context: `token_slots`)
    pos,  # [BLOCK_N] positions, the first a multiple of BLOCK_N
    mask_n,  # [BLOCK_N] positions inside the context, or None: all of them
    offs_d,  # [HEAD_DIM]
    stride_vt,  # V's stride of a token (16-bit pools) or of a page (PAGED_T)
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PAGED_T: tl.constexpr,
):  # fmt: skip
    """A [BLOCK_N, HEAD_DIM] block of V. PAGED_T (an FP8 pool, `minisgl.kernels.fp8`): pages
    stored [Hkv, D, PAGE_SIZE], read as [HEAD_DIM, BLOCK_N] (the P V product's layout, no byte
    shuffles), unmasked (a mask would split the 16-byte loads): keys past the context read their
    last page's other slots, finite in such a pool, which the caller's softmax weighs 0."""
    if PAGED_T:
        # Runs of keys in one page, aligned: the largest power of two dividing PAGE_SIZE (any
        # page size works), at most BLOCK_N (blocks start at multiples of BLOCK_N).
        low: tl.constexpr = PAGE_SIZE & (-PAGE_SIZE)
        run: tl.constexpr = low if low < BLOCK_N else BLOCK_N
        page = tl.max_constancy((slots // PAGE_SIZE) * stride_vt, run)
        in_page = tl.max_contiguous(tl.multiple_of(pos % PAGE_SIZE, run), run)
        v_t = tl.load(v_head_ptr + offs_d[:, None] * PAGE_SIZE + page[None, :] + in_page[None, :])
        v = tl.trans(v_t)
    else:
        ptrs = v_head_ptr + slots[:, None] * stride_vt + offs_d[None, :]
        if mask_n is None:
            v = tl.load(ptrs)
        else:
            v = tl.load(ptrs, mask=mask_n[:, None], other=0.0)
    return v


@triton.jit
def v_row_ptrs(
    v_ptr, slot, offs_h, offs_d, stride_vt, stride_vh, PAGE_SIZE: tl.constexpr,
    PAGED_T: tl.constexpr,
):  # fmt: skip
    """[H, D] pointers of token `slot`'s V in a V cache: rows [slots, Hkv, D] (`stride_vt` a
    token's stride), or PAGED_T, an FP8 pool's pages [Hkv, D, PAGE_SIZE] (`stride_vt` a page's)."""
    if PAGED_T:
        base = v_ptr + (slot // PAGE_SIZE) * stride_vt + slot % PAGE_SIZE
        ptrs = base + offs_h[:, None] * stride_vh + offs_d[None, :] * PAGE_SIZE
    else:
        ptrs = v_ptr + slot * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    return ptrs


@triton.jit
def token_slots(table_row_ptr, pos, PAGE_SIZE: tl.constexpr):
    """KV slots (int64) of positions `pos` (inside the request's pages: clamp positions past
    its end) of one request whose page ids start at `table_row_ptr`."""
    page = tl.load(table_row_ptr + pos // PAGE_SIZE)
    return page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE


@triton.jit
def softmax_init(ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The running softmax of ROWS rows before any key: (m_i -inf, l_i 0, acc 0)."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    return m_i, tl.zeros([ROWS], tl.float32), tl.zeros([ROWS, HEAD_DIM], tl.float32)


@triton.jit
def online_softmax_step(
    qk, v, m_i, l_i, acc, IEEE: tl.constexpr, EMULATE_BF16: tl.constexpr,
    MAY_BE_EMPTY: tl.constexpr = False,
):  # fmt: skip
    """Fold one key block into the running softmax (base-2 domain).

    qk [M, N] fp32 scores already multiplied by sm_scale * log2(e), masked keys at -inf; v [N, D];
    m_i, l_i [M]; acc [M, D]. Without MAY_BE_EMPTY every row must have seen a finite score by
    its first block; with it a row may see only masked keys for a while (it keeps m_i = -inf,
    l_i = 0, acc = 0 until a visible key comes, and for good when none comes).
    """
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_ref = m_new
    if MAY_BE_EMPTY:  # -inf - -inf would be NaN
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(qk - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if EMULATE_BF16:
        pv = dot(round_bf16(p), v, IEEE, EMULATE_BF16)
    else:
        pv = dot(p.to(v.dtype), v, IEEE, EMULATE_BF16)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def load_q(ptrs, mask, scale_log2, k_scale_ptr, kv_head, KV_FP8: tl.constexpr):
    """A tile of queries (rows where `mask`, zeros elsewhere) and the factor of its scores,
    sm_scale * log2(e): with an FP8 cache q is widened to the dots' operand type and the factor
    takes K's scale (the e4m3 K/V tiles are widened in registers; their scales act on scores
    and output)."""
    q = tl.load(ptrs, mask=mask[:, None], other=0.0)
    qk_scale = scale_log2
    if KV_FP8:
        q = fp8_operand(q, q)
        qk_scale = scale_log2 * tl.load(k_scale_ptr + kv_head)
    return q, qk_scale


@triton.jit
def attend_keys(
    q,  # [ROWS, D], widened for FP8 K/V
    q_pos,  # [ROWS] positions of the rows' tokens (CAUSAL)
    table_row,  # pointer to the request's page ids
    k_base,  # [1, D] pointers of the KV head at slot 0
    v_base,  # the V of the KV head (a scalar pointer: `load_v_block`)
    stride_kt, stride_vt, m_i, l_i, acc,
    start,  # first key
    end,  # keys are < end
    qk_scale,
    CAUSAL: tl.constexpr,  # mask key k of row r unless k <= q_pos[r] (else: only k < end)
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, KV_FP8: tl.constexpr, IEEE: tl.constexpr,
    EMULATE_BF16: tl.constexpr, MAY_BE_EMPTY: tl.constexpr = False,
    MASKED: tl.constexpr = True,  # False: whole blocks, every key visible to every row
):  # fmt: skip
    """Fold keys start .. end - 1 of one request into a tile's running softmax: the loop of
    every attention kernel (decode, extend, mixed)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, q.shape[1])
    for n in range(start, end, BLOCK_N):
        k_pos = n + offs_n
        if MASKED:
            mask_n = k_pos < end
            slots = token_slots(table_row, tl.minimum(k_pos, end - 1), PAGE_SIZE)
            k = tl.load(k_base + slots[:, None] * stride_kt, mask=mask_n[:, None], other=0.0)
        else:
            mask_n = None
            slots = token_slots(table_row, k_pos, PAGE_SIZE)
            k = tl.load(k_base + slots[:, None] * stride_kt)
        if KV_FP8:
            k = fp8_operand(k, q)
        qk = dot(q, tl.trans(k), IEEE, EMULATE_BF16) * qk_scale
        if MASKED:
            visible = mask_n[None, :]
            if CAUSAL:
                visible = visible & (k_pos[None, :] <= q_pos[:, None])
            qk = tl.where(visible, qk, float("-inf"))
        v = load_v_block(
            v_base, slots, k_pos, mask_n, offs_d, stride_vt, PAGE_SIZE, BLOCK_N, KV_FP8
        )
        if KV_FP8:
            v = fp8_operand(v, q)
        m_i, l_i, acc = online_softmax_step(qk, v, m_i, l_i, acc, IEEE, EMULATE_BF16, MAY_BE_EMPTY)
    return m_i, l_i, acc


@triton.jit
def normalize(acc, l_i, v_scale_ptr, kv_head, KV_FP8: tl.constexpr):
    """(acc / l: the attention output of each row, zeros for a row that saw no key, times V's
    scale for an FP8 cache; l with those rows at 1, for the log-sum-exp)."""
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if KV_FP8:
        out = out * tl.load(v_scale_ptr + kv_head)
    return out, l_safe


@triton.jit
def kv_split_len(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Keys per split when a request of `seq_len` keys is split `num_splits` ways (flash
    decoding): a whole number of BLOCK_N blocks, so splits past the end of a short request are
    empty and `tl.cdiv(seq_len, kv_split_len(...))` of them hold keys."""
    per_split = tl.cdiv(seq_len, num_splits)
    return tl.maximum(tl.cdiv(per_split, BLOCK_N), 1) * BLOCK_N


@triton.jit
def combine_splits(
    part_o_ptr,  # [rows * num_splits, D] fp32: split s of row r at r * num_splits + s
    part_lse_ptr,  # [rows * num_splits] fp32, base-2 log-sum-exps
    o_dst,  # [BLOCK_H, D] output pointers of the tile's rows
    rows,  # [BLOCK_H] index of split 0 of each tile row in the partial buffers
    num_valid,  # splits that wrote partials
    mask_h,  # [BLOCK_H] real rows of the tile
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    """Softmax-weighted sum of the splits' normalised partial outputs (base-2 log-sum-exps),
    run by the last split to finish (decode and mixed attention). The partials were written by
    other programs: the loads bypass L1 (.cg)."""
    offs_d = tl.arange(0, HEAD_DIM)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    weight = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for s in range(0, num_valid):
        lse = tl.load(part_lse_ptr + rows + s, mask=mask_h, other=0.0, cache_modifier=".cg")
        part = tl.load(
            part_o_ptr + (rows + s)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=mask_h[:, None],
            other=0.0,
            cache_modifier=".cg",
        )
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha[:, None] + w[:, None] * part
        weight = weight * alpha + w
        m = m_new
    out = acc / tl.where(weight > 0, weight, 1.0)[:, None]  # an empty request gets zeros
    if EMULATE_BF16:
        out = round_bf16(out)
    tl.store(o_dst, out.to(o_dst.dtype.element_ty), mask=mask_h[:, None])
