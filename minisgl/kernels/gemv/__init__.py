"""Linear layers of a few rows with their work around them fused in: `gemv` (one row on the CUDA
cores, FP8 weights in its vec layout) and `skinny` (1..16 rows on tensor cores)."""
