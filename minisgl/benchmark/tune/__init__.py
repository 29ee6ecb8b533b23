"""The kernels' tuners, one entry: `python -m minisgl.benchmark.tune KERNEL [options]`.

Each sweeps a kernel's tiles (or a switch) on the CUDA GPU at hand and prints the table to paste
beside the kernel: `gemv` (`--fp8`), `skinny`, `fp8-gemm` (`linear.py`); `decode`, `extend`,
`mixed` (`attention.py`); `moe`, `moe-fp8`, `w8a8` (`moe.py`). The last line is one JSON object.
"""
