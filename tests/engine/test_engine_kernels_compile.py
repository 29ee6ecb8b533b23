"""The engine's own Triton kernels (fused layers, Gumbel-max sampling) compile for Hopper (sm_90)
on a machine without a GPU: the CPU interpreter does not type-check or lower a kernel, so
integer-width and constant-typing mistakes only show up here (or on the GPU).
`PYTHONPATH=tests python tests/engine/test_engine_kernels_compile.py` prints the shared memory
of each kernel."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sm90 import compile_sm90, run_compile_script


def _compile(kernel: Any, types: dict[str, str], constexprs: dict[str, Any], warps: int) -> int:
    """Compile to a cubin for sm_90; returns the shared memory it uses."""
    return compile_sm90(kernel, types, constexprs, warps)["shared"]


def _compile_all() -> list[dict[str, Any]]:
    from minisgl.engine.sample_kernel import _gumbel_argmax_kernel
    from minisgl.kernels.fused import _qk_norm_rope_kernel, _rms_norm_kernel, _silu_and_mul_kernel

    out = []
    types = {"logits_ptr": "*fp32", "temperature_ptr": "*fp32", "keys_ptr": "*i64"}
    types |= {"part_score_ptr": "*fp32", "part_index_ptr": "*i64"}
    c = dict(NUM_BLOCKS=38, BLOCK=4096)
    out.append(("gumbel_argmax", _compile(_gumbel_argmax_kernel, types, c, 8)))
    for dt in ("bf16", "fp32"):
        types = {n: f"*{dt}" for n in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr")}
        types["eps"] = "fp32"
        for res in (True, False):
            c = dict(HAS_RESIDUAL=res, BLOCK=1024)
            out.append((f"rms_norm {dt} res={res}", _compile(_rms_norm_kernel, types, c, 4)))
        names = ("q_ptr", "k_ptr", "v_ptr", "q_out_ptr", "k_out_ptr", "k_cache_ptr", "v_cache_ptr")
        types = {n: f"*{dt}" for n in names}
        types |= {"q_w_ptr": f"*{dt}", "k_w_ptr": f"*{dt}", "pos_ptr": "*i64", "loc_ptr": "*i64"}
        types |= {"cos_sin_ptr": "*fp32", "eps": "fp32"}
        types |= {"k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "k_shift_ptr": "*fp32"}
        for norm, store in ((True, True), (True, False), (False, True), (False, False)):
            c = dict(HAS_NORM=norm, STORE=store, KV_FP8=False, EMULATE_FP8=False, HALF=64)
            name = f"qk_norm_rope {dt} norm={norm} store={store}"
            out.append((name, _compile(_qk_norm_rope_kernel, types, c | dict(BLOCK_H=16), 4)))
        # Into an FP8 (e4m3) pool.
        c = dict(HAS_NORM=True, STORE=True, KV_FP8=True, EMULATE_FP8=False, HALF=64, BLOCK_H=16)
        fp8_types = types | {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
        out.append(
            (f"qk_norm_rope {dt} store fp8", _compile(_qk_norm_rope_kernel, fp8_types, c, 4))
        )
        types = {"x_ptr": f"*{dt}", "out_ptr": f"*{dt}"}
        out.append((f"silu_and_mul {dt}", _compile(_silu_and_mul_kernel, types, {"BLOCK": 1024}, 4)))  # fmt: skip
    return [{"name": n, "shared": s} for n, s in out]


@pytest.mark.slow
def test_engine_kernels_compile_for_sm90() -> None:
    pytest.importorskip("triton", reason="Triton is not installed (optional dependency 'gpu')")
    results = run_compile_script(__file__)
    assert len(results) == 17, results


if __name__ == "__main__":
    for result in _compile_all():
        print(json.dumps(result))
