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
]  # fmt: skip
EXTEND = [
    ("extend bf16 d128 g2 ps16", "bf16", dict(GROUP=2, HEAD_DIM=128, BLOCK_M=128, BLOCK_N=64, PAGE_SIZE=16), 8, 2),
    ("extend fp32 d64 g3 ps1", "fp32", dict(GROUP=3, HEAD_DIM=64, BLOCK_M=64, BLOCK_N=32, PAGE_SIZE=1), 4, 2),
    ("extend bf16 d256 g4 ps64", "bf16", dict(GROUP=4, HEAD_DIM=256, BLOCK_M=64, BLOCK_N=32, PAGE_SIZE=64), 8, 2),
]  # fmt: skip
POINTERS_16 = {"q_ptr", "k_ptr", "v_ptr", "o_ptr", "block_table_ptr", "seq_lens_ptr"}


def _compile(kernel: Any, types: dict[str, str], constexprs: dict[str, Any], warps: int, stages: int) -> dict[str, Any]:  # fmt: skip
    # What the launcher would specialise: 16-byte aligned pointers and strides divisible by 16.
    names = kernel.arg_names
    aligned = [n for n in names if n.startswith("stride") or types.get(n, "").startswith("*")]
    return compile_sm90(kernel, types, constexprs, warps, stages, aligned)


def _compile_all() -> list[dict[str, Any]]:
    from minisgl.kernels.decode import _decode_split_kernel
    from minisgl.kernels.extend import _extend_kernel
    from minisgl.kernels.store import _store_kv_kernel

    results = []
    for name, dtype, c, warps, stages in DECODE:
        types = {n: f"*{dtype}" for n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")}
        types |= {"block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "scale_log2": "fp32"}
        types |= {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "counter_ptr": "*i32"}
        block_h = max(16, 1 << (c["GROUP"] - 1).bit_length())
        c = c | dict(BLOCK_H=block_h, IEEE=dtype == "fp32", EMULATE_BF16=False)
        results.append({"name": name, **_compile(_decode_split_kernel, types, c, warps, stages)})
    for name, dtype, c, warps, stages in EXTEND:
        types = {n: f"*{dtype}" for n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")}
        types |= {n: "*i32" for n in ("block_table_ptr", "seq_lens_ptr", "extend_lens_ptr")}
        types |= {"cu_extend_ptr": "*i32", "scale_log2": "fp32"}
        c = c | dict(IEEE=dtype == "fp32", EMULATE_BF16=False)
        results.append({"name": name, **_compile(_extend_kernel, types, c, warps, stages)})
    types = {n: "*bf16" for n in ("k_cache_ptr", "v_cache_ptr", "k_ptr", "v_ptr")}
    c = dict(NUM_HEADS=8, BLOCK_H=8, HEAD_DIM=128)
    store = _compile(_store_kv_kernel, types | {"loc_ptr": "*i64"}, c, 4, 1)
    results.append({"name": "store_kv bf16 8x128", **store})
    return results


@pytest.mark.slow
def test_kernels_compile_for_sm90() -> None:
    pytest.importorskip("triton", reason="Triton is not installed (optional dependency 'gpu')")
    results = run_compile_script(__file__)
    assert len(results) == len(DECODE) + len(EXTEND) + 1
    spilled = [r["name"] for r in results if r["local"] > 0 and "d256" not in r["name"]]
    assert not spilled, f"register spills in {spilled}: {results}"


if __name__ == "__main__":
    for result in _compile_all():
        print(json.dumps(result))
