"""Run a benchmark module with the decode attention's default config changed, to A/B a
`DecodeConfig` field inside the engine before it becomes a default.

    python scripts/decode_config_run.py min_split_tokens=4096,tail_n=32 \\
        minisgl.benchmark.latency --model ... [its arguments]

The fields apply to every head dim and KV dtype (`default_decode_config`'s result, replaced).
The engine must run in this process (tp 1), as the benchmarks' engines do.
"""

from __future__ import annotations

import dataclasses
import runpy
import sys
from typing import Any

import minisgl.kernels.decode as decode


def main() -> None:
    fields: dict[str, Any] = {}
    for item in filter(None, sys.argv[1].split(",")):
        name, value = item.split("=")
        fields[name] = int(value)
    base = decode.default_decode_config

    def patched(head_dim: int, kv_fp8: bool = False) -> decode.DecodeConfig:
        return dataclasses.replace(base(head_dim, kv_fp8), **fields)

    import minisgl.attention.triton_backend as backend

    decode.default_decode_config = patched
    backend.default_decode_config = patched  # (imported by name there)
    print(f"decode config fields: {fields}", flush=True)
    sys.argv = [sys.argv[2], *sys.argv[3:]]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
