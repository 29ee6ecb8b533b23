"""Device kernels (Triton), one subpackage per family, with its tile helpers and tables:

- `attention/`: paged decode, extend and mixed-step attention, the KV store (`reference` and
  `testing` are pure torch);
- `gemv/`: fused linear layers of a few rows (`gemv`: one row, CUDA cores; `skinny`: 1..16 rows
  on tensor cores), 16-bit or FP8 weights;
- `moe/`: routing, the blocked and pair paths, the W8A8 path, their tile tables;
- `fp8/`: e4m3 numerics in torch (the package itself) and the FP8 GEMM (`gemm`);
- `lowbit/`: 4/8-bit integer weights (the layout; torch's CPU kernel; Triton on CUDA);
- `fused.py`: RMSNorm, q/k norm + RoPE (+ KV store), SiLU-and-multiply, and the kernels the
  layers call (`minisgl.layers.fused`); `common.py`: what every family shares.

Importing `minisgl.kernels`, `.attention`, `.fp8`, `.attention.reference` or
`.attention.testing` does not import Triton, so CPU-only installs can use the references.
"""
