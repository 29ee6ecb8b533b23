"""Fused mixture-of-experts kernels: `layer` (the entry points), `routing`, `blocked` and `pair`
(the two weight-only paths), `w8a8` (FP8 activations too), `tiles` (the tile tables)."""
