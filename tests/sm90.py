"""Compiling Triton kernels for Hopper (sm_90) on a machine without a GPU.

The CPU interpreter neither type-checks nor lowers kernels, so errors that only the real
compiler sees (integer widths, constant typing, register spills, shared memory) need a compile
down to a cubin, with the ptxas and cuobjdump that ship in the triton wheel. It runs in a
subprocess without TRITON_INTERPRET: a test file runs itself (`run_compile_script(__file__)`)
and prints one JSON object per compiled variant.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest


def compile_sm90(
    kernel: Any,
    types: dict[str, str],
    constexprs: dict[str, Any],
    warps: int,
    stages: int | None = None,
    aligned: Iterable[str] = (),
    sass: bool = False,
) -> dict[str, Any]:
    """Compile `kernel` (arguments not in `types` are i32) for sm_90; `aligned` arguments are
    taken as multiples of 16, as the launcher would specialise them. Returns shared memory
    bytes, registers and local (spilled) bytes per thread, and the layout conversions inside
    its loops (`loop_converts`: each one a shared-memory round trip per iteration, mostly);
    with `sass`, also `loops`: the SASS instructions of each loop body (`sass_loops`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    if "PDL" in names:  # as launched on Hopper: with the programmatic-dependent-launch prologue
        constexprs = {"PDL": True, **constexprs}
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    target = GPUTarget("cuda", 90, 32)
    opts: dict[str, Any] = {"num_warps": warps}
    if stages is not None:
        opts["num_stages"] = stages
    options = triton.compiler.make_backend(target).parse_options(opts)
    compiled = triton.compile(src, target=target, options=options.__dict__)
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
        code = ""
        if sass:
            code = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    fields = dict(kv.split(":") for kv in text.split() if kv.startswith(("REG:", "LOCAL:")))
    out: dict[str, Any] = {
        "shared": int(compiled.metadata.shared),
        "regs": int(fields["REG"]),
        "local": int(fields["LOCAL"]),
        "loop_converts": _loop_converts(compiled.asm["ttgir"]),
    }
    if sass:
        out["loops"] = sass_loops(code)
    return out


def sass_loops(sass: str) -> list[dict[str, int]]:
    """The loops of a `cuobjdump -sass` listing (a branch back to an earlier address closes
    one), each as its instruction count ("total") and the count of each opcode in it."""
    code = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            code.append((int(m.group(1), 16), m.group(2)))
    loops = []
    for addr, text in code:
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            start = int(target.group(1), 16)
            ops = [t.split()[1] if t.startswith("@") else t.split()[0]
                   for a, t in code if start <= a <= addr]  # fmt: skip
            counts = {op: ops.count(op) for op in sorted(set(ops))}
            loops.append({"total": len(ops), **counts})
    return loops


def _loop_converts(ttgir: str) -> int:
    """`ttg.convert_layout` ops between an `scf.for` and its `scf.yield` (nesting ignored)."""
    count, depth = 0, 0
    for line in ttgir.splitlines():
        depth += "scf.for" in line
        count += depth > 0 and "ttg.convert_layout" in line
        depth -= depth > 0 and "scf.yield" in line
    return count


def run_compile_script(script: str, *args: str) -> list[dict[str, Any]]:
    """Run `script` (with `args`) in a subprocess without the interpreter; the JSON objects it
    printed. Skips when this triton build has no ptxas."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silences a deprecation warning of newer tritons
    tests_dir = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, script, *args], capture_output=True, text=True, env=env, timeout=600
    )
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("this triton build has no bundled ptxas")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
