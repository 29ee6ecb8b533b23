"""The engine's own Triton kernels (fused layers, Gumbel-max sampling) compile for Hopper (sm_90)
on a machine without a GPU: the CPU interpreter does not type-check or lower a kernel, so
integer-width and constant-typing mistakes only show up here (or on the GPU).
Run this file directly to print register use of each kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest


def _compile(kernel: Any, types: dict[str, str], constexprs: dict[str, Any], warps: int) -> int:
    """Compile to a cubin for sm_90; returns the shared memory it uses."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    target = GPUTarget("cuda", 90, 32)
    options = triton.compiler.make_backend(target).parse_options({"num_warps": warps})
    compiled = triton.compile(src, target=target, options=options.__dict__)
    assert compiled.asm["cubin"]
    return int(compiled.metadata.shared)


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
        types = {n: f"*{dt}" for n in ("q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr")}
        types |= {"q_w_ptr": f"*{dt}", "k_w_ptr": f"*{dt}", "pos_ptr": "*i64"}
        types |= {"cos_sin_ptr": "*fp32", "eps": "fp32"}
        for norm in (True, False):
            c = dict(HAS_NORM=norm, HALF=64, BLOCK_H=16)
            out.append((f"qk_norm_rope {dt} norm={norm}", _compile(_qk_norm_rope_kernel, types, c, 4)))  # fmt: skip
        types = {"x_ptr": f"*{dt}", "out_ptr": f"*{dt}"}
        out.append((f"silu_and_mul {dt}", _compile(_silu_and_mul_kernel, types, {"BLOCK": 1024}, 4)))  # fmt: skip
    return [{"name": n, "shared": s} for n, s in out]


@pytest.mark.slow
def test_engine_kernels_compile_for_sm90() -> None:
    pytest.importorskip("triton", reason="Triton is not installed (optional dependency 'gpu')")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run(
        [sys.executable, __file__], capture_output=True, text=True, env=env, timeout=600
    )
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("this triton build has no bundled ptxas")
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 11, results


if __name__ == "__main__":
    for result in _compile_all():
        print(json.dumps(result))
