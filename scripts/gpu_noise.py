"""How far bf16 paths are from the fp32 reference on the GPU test model (a diagnostic).

Prints max |top-1 log-prob diff| against fp32 for: the bf16 reference path (torch attention,
unfused layers, eager, plain loop) and the bf16 fast path (Triton, fused, graphs, overlap).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import test_engine_gpu as t  # noqa: E402

from minisgl.layers.fused import set_fused_enabled  # noqa: E402


def worst(a, b):
    w = 0.0
    for r, g in zip(a, b):
        for j, (rt, gt) in enumerate(zip(r["top_logprobs"], g["top_logprobs"])):
            if r["token_ids"][j] != g["token_ids"][j]:
                break
            w = max(w, abs(rt[0][1] - gt[0][1]))
    return w


ps = t.prompts()
ref32 = t.reference_generate(ps, t.PARAMS)
set_fused_enabled(False)
ref16 = t.make_llm(fast=False).generate(ps, t.PARAMS, use_tqdm=False)
set_fused_enabled(True)
fast16 = t.make_llm(fast=True).generate(ps, t.PARAMS, use_tqdm=False)
print(f"bf16 reference path vs fp32: {worst(ref32, ref16):.4f}")
print(f"bf16 fast path vs fp32:      {worst(ref32, fast16):.4f}")
print(f"bf16 fast path vs bf16 ref:  {worst(ref16, fast16):.4f}")
