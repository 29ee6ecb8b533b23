"""The mixed-step attention kernel compiles for Hopper (sm_90) without a GPU, without spills.

`PYTHONPATH=tests python tests/kernels/test_mixed_attention_compile.py` prints register and
shared-memory use of each variant (see tests/kernels/test_attention_kernels_compile.py).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from sm90 import compile_sm90, run_compile_script

# (name, q dtype, constexprs, num_warps, num_stages); tiles not given are the default config's
# (MixedConfig: 64 wide rows, 64 keys per wide step, 128 per narrow step, 4 warps, 2 stages,
# which fp32 at head_dim 64 gets too), the last three the smaller default of wide heads and
# fp32 at head_dim 128 (32 rows, 32 keys, 4 warps).
SMALL_TILES = dict(ROWS_W=32, BLOCK_N=32, BLOCK_N_NARROW=32)
MIXED = [
    ("mixed bf16 d128 g2 ps16", "bf16", dict(GROUP=2, GPAD=2, HEAD_DIM=128, PAGE_SIZE=16), 4, 2),
    ("mixed bf16 d128 g2 ps1 split", "bf16", dict(GROUP=2, GPAD=2, HEAD_DIM=128, PAGE_SIZE=1, SPLIT=True), 4, 2),
    ("mixed bf16 d128 g2 ps16 split", "bf16", dict(GROUP=2, GPAD=2, HEAD_DIM=128, PAGE_SIZE=16, SPLIT=True), 4, 2),
    ("mixed bf16 d128 g4 ps16 split", "bf16", dict(GROUP=4, GPAD=4, HEAD_DIM=128, PAGE_SIZE=16, SPLIT=True), 4, 2),
    ("mixed bf16 d128 g3 ps32 rows128", "bf16", dict(GROUP=3, GPAD=4, HEAD_DIM=128, PAGE_SIZE=32, ROWS_W=128), 4, 2),
    ("mixed bf16 fp8kv d128 g2 ps32 split", "bf16", dict(GROUP=2, GPAD=2, HEAD_DIM=128, PAGE_SIZE=32, SPLIT=True, KV_FP8=True), 4, 2),
    ("mixed bf16 fp8kv d128 g2 ps32", "bf16", dict(GROUP=2, GPAD=2, HEAD_DIM=128, PAGE_SIZE=32, KV_FP8=True), 4, 2),
    ("mixed bf16 d128 g16 ps16 split", "bf16", dict(GROUP=16, GPAD=16, HEAD_DIM=128, PAGE_SIZE=16, SPLIT=True), 4, 2),
    ("mixed fp32 d64 g2 ps16 split", "fp32", dict(GROUP=2, GPAD=2, HEAD_DIM=64, PAGE_SIZE=16, SPLIT=True), 4, 2),
    ("mixed fp32 d128 g2 ps16 split", "fp32", dict(GROUP=2, GPAD=2, HEAD_DIM=128, PAGE_SIZE=16, SPLIT=True, **SMALL_TILES), 4, 2),
    ("mixed fp32 d64 g2 ps16 split small", "fp32", dict(GROUP=2, GPAD=2, HEAD_DIM=64, PAGE_SIZE=16, SPLIT=True, **SMALL_TILES), 4, 2),
    ("mixed bf16 d256 g4 ps64 split", "bf16", dict(GROUP=4, GPAD=4, HEAD_DIM=256, PAGE_SIZE=64, SPLIT=True, **SMALL_TILES), 4, 2),
]  # fmt: skip


def _compile_all() -> list[dict[str, Any]]:
    from minisgl.kernels.attention.mixed import _mixed_kernel

    results = []
    for name, dtype, c, warps, stages in MIXED:
        cache = "fp8e4nv" if c.get("KV_FP8") else dtype
        types = {"q_ptr": f"*{dtype}", "o_ptr": f"*{dtype}", "k_ptr": f"*{cache}"}
        types |= {"v_ptr": f"*{cache}", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
        types |= {n: "*i32" for n in ("block_table_ptr", "seq_lens_ptr", "cu_extend_ptr")}
        types |= {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "counter_ptr": "*i32"}
        types |= {"scale_log2": "fp32"}
        base = dict(BLOCK_B=256, ROWS_W=64, BLOCK_N=64, BLOCK_N_NARROW=128, SPLIT=False)
        base |= dict(KV_FP8=False, IEEE=dtype == "fp32", EMULATE_BF16=False)
        c = base | c | {"ROWS_N": max(16, c["GPAD"])}
        names = _mixed_kernel.arg_names
        aligned = [n for n in names if n.startswith("stride") or types.get(n, "").startswith("*")]
        compiled = compile_sm90(_mixed_kernel, types, c, warps, stages, aligned)
        results.append({"name": name, **compiled})
    return results


@pytest.mark.slow
def test_mixed_kernel_compiles_for_sm90() -> None:
    pytest.importorskip("triton", reason="Triton is not installed (optional dependency 'gpu')")
    results = run_compile_script(__file__)
    assert len(results) == len(MIXED)
    spilled = [r["name"] for r in results if r["local"] > 0]
    assert not spilled, f"register spills in {spilled}: {results}"
    assert all(r["shared"] <= 227 * 1024 for r in results), results


if __name__ == "__main__":
    for result in _compile_all():
        print(json.dumps(result))
