"""The Triton kernels compile for Hopper (sm_90) on a machine without a GPU.

The CPU interpreter neither type-checks nor lowers kernels, so it misses errors that only the
real compiler sees. This test runs Triton's compiler down to a cubin (with the ptxas that ships
in the triton wheel) in a subprocess without TRITON_INTERPRET, and checks for register spills.
`PYTHONPATH=tests python tests/kernels/test_attention_kernels_compile.py` prints register and
shared-memory use of each variant.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from sm90 import compile_sm90, run_compile_script

# (name, kernel, dtype, constexprs, num_warps, num_stages)
DECODE = [
    ("decode bf16 d128 g2 ps16", "bf16", dict(GROUP=2, HEAD_DIM=128, BLOCK_N=64, PAGE_SIZE=16, SINGLE_SPLIT=True), 4, 2),
    ("decode bf16 d64 g3 ps1 split", "bf16", dict(GROUP=3, HEAD_DIM=64, BLOCK_N=128, PAGE_SIZE=1, SINGLE_SPLIT=False), 4, 3),
    ("decode fp32 d128 g1 ps16 split", "fp32", dict(GROUP=1, HEAD_DIM=128, BLOCK_N=64, PAGE_SIZE=16, SINGLE_SPLIT=False), 4, 2),
    ("decode fp16 d256 g8 ps64", "fp16", dict(GROUP=8, HEAD_DIM=256, BLOCK_N=32, PAGE_SIZE=64, SINGLE_SPLIT=True), 4, 2),
    # FP8 (e4m3) KV: the default config (`default_decode_config(head_dim, kv_fp8=True)`: 4 warps,
    # 3 stages, 128 keys at head_dim 128) at W1's shape, one program per request and split;
    # V pages transposed (`KVPool`): ~124 registers (200-254 with V in rows)
    ("decode bf16 fp8kv d128 g2 ps32", "bf16", dict(GROUP=2, HEAD_DIM=128, BLOCK_N=128, PAGE_SIZE=32, SINGLE_SPLIT=True, KV_FP8=True), 4, 3),
    ("decode bf16 fp8kv d128 g4 ps32 split", "bf16", dict(GROUP=4, HEAD_DIM=128, BLOCK_N=128, PAGE_SIZE=32, SINGLE_SPLIT=False, KV_FP8=True), 4, 3),
    ("decode bf16 fp8kv d64 g2 ps32", "bf16", dict(GROUP=2, HEAD_DIM=64, BLOCK_N=256, PAGE_SIZE=32, SINGLE_SPLIT=True, KV_FP8=True), 4, 3),
]  # fmt: skip
EXTEND = [
    ("extend bf16 d128 g2 ps16", "bf16", dict(GROUP=2, HEAD_DIM=128, BLOCK_M=128, BLOCK_N=64, PAGE_SIZE=16), 8, 2),
    ("extend fp32 d64 g3 ps1", "fp32", dict(GROUP=3, HEAD_DIM=64, BLOCK_M=64, BLOCK_N=32, PAGE_SIZE=1), 4, 2),
    ("extend bf16 d256 g4 ps64", "bf16", dict(GROUP=4, HEAD_DIM=256, BLOCK_M=64, BLOCK_N=32, PAGE_SIZE=64), 8, 2),
    ("extend bf16 fp8kv d128 g2 ps32", "bf16", dict(GROUP=2, HEAD_DIM=128, BLOCK_M=128, BLOCK_N=128, PAGE_SIZE=32, KV_FP8=True), 8, 3),
]  # fmt: skip


def _compile(kernel: Any, types: dict[str, str], constexprs: dict[str, Any], warps: int, stages: int) -> dict[str, Any]:  # fmt: skip
    # What the launcher would specialise: 16-byte aligned pointers and strides divisible by 16.
    names = kernel.arg_names
    aligned = [n for n in names if n.startswith("stride") or types.get(n, "").startswith("*")]
    return compile_sm90(kernel, types, constexprs, warps, stages, aligned)


def _compile_all() -> list[dict[str, Any]]:
    from minisgl.kernels.attention.decode import _decode_split_kernel
    from minisgl.kernels.attention.extend import _extend_kernel
    from minisgl.kernels.attention.store import _store_kv_kernel

    results = []
    for name, dtype, c, warps, stages in DECODE:
        types = _kv_types(dtype, c)
        types |= {"block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "scale_log2": "fp32"}
        types |= {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "counter_ptr": "*i32"}
        block_h = max(16, 1 << (c["GROUP"] - 1).bit_length())
        c = {"KV_FP8": False} | c | dict(BLOCK_H=block_h, IEEE=dtype == "fp32", EMULATE_BF16=False)
        results.append({"name": name, **_compile(_decode_split_kernel, types, c, warps, stages)})
    for name, dtype, c, warps, stages in EXTEND:
        types = _kv_types(dtype, c)
        types |= {n: "*i32" for n in ("block_table_ptr", "seq_lens_ptr", "extend_lens_ptr")}
        types |= {"cu_extend_ptr": "*i32", "scale_log2": "fp32"}
        c = {"KV_FP8": False} | c | dict(IEEE=dtype == "fp32", EMULATE_BF16=False)
        results.append({"name": name, **_compile(_extend_kernel, types, c, warps, stages)})
    for cache in ("bf16", "fp8e4nv"):
        types = {"k_ptr": "*bf16", "v_ptr": "*bf16", "loc_ptr": "*i64"}
        types |= {"k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}"}
        types |= {"k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "k_shift_ptr": "*fp32"}
        fp8 = cache == "fp8e4nv"
        c = dict(NUM_HEADS=8, BLOCK_H=8, HEAD_DIM=128, KV_FP8=fp8, EMULATE_FP8=False, PAGE_SIZE=32)
        store = _compile(_store_kv_kernel, types, c, 4, 1)
        results.append({"name": f"store_kv {cache} 8x128", **store})
    return results


def _kv_types(dtype: str, constexprs: dict[str, Any]) -> dict[str, str]:
    """Pointer types of q, the caches and the output; the caches are e4m3 with KV_FP8."""
    cache = "fp8e4nv" if constexprs.get("KV_FP8") else dtype
    types = {"q_ptr": f"*{dtype}", "o_ptr": f"*{dtype}"}
    return (
        types
        | {"k_ptr": f"*{cache}", "v_ptr": f"*{cache}"}
        | {"k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    )


@pytest.mark.slow
def test_kernels_compile_for_sm90() -> None:
    pytest.importorskip("triton", reason="Triton is not installed (optional dependency 'gpu')")
    results = run_compile_script(__file__)
    assert len(results) == len(DECODE) + len(EXTEND) + 2
    spilled = [r["name"] for r in results if r["local"] > 0 and "d256" not in r["name"]]
    assert not spilled, f"register spills in {spilled}: {results}"


if __name__ == "__main__":
    for result in _compile_all():
        print(json.dumps(result))
