#!/usr/bin/env bash
# session 17 device call E: the FP8 pair kernels (batch-1 MoE) and the W8A8 blocked path
# (batch 256) on the H200: GPU tests, the pair tile sweep, decode against bf16.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
O=${OUT:-/tmp/o}; mkdir -p $O
step() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$(date +%s); timeout -k 5 $t "$@" > $O/$n.log 2>&1; echo "rc=$? $(( $(date +%s)-t0 ))s"; tail -${TAILN:-3} $O/$n.log | cut -c1-220; }
MOE="python3 -m minisgl.benchmark.moe --skip-kernels"
step tests 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_moe_gpu.py tests/kernels/test_moe_kernel.py tests/kernels/test_moe_fp8.py -k "not compile"
TAILN=6 step tune_fp8 120 python3 -m minisgl.benchmark.moe --tune-fp8 --tune-tokens 1
step moe_fp8 110 $MOE --decode-batches 1,256 --quantization fp8
step moe_fp8_w8a8 90 $MOE --decode-batches 256 --quantization fp8 --moe-fp8-w8a8
step moe_bf16 110 $MOE --decode-batches 1,256
python3 - $O << 'PY'
import json, sys
from pathlib import Path
def last(n):
    p = Path(sys.argv[1]) / f"{n}.log"
    for line in reversed(p.read_text(errors="replace").splitlines() if p.exists() else []):
        if line.startswith("{"):
            try: return json.loads(line)
            except ValueError: return None
r = {n: {d["batch"]: d for d in (last(n) or {}).get("decode", [])} for n in ("moe_fp8", "moe_fp8_w8a8", "moe_bf16")}
for n, rows in r.items():
    for b, d in sorted(rows.items()):
        print(f"{n:14} bs{b:<4} {d['tok_per_s']:9.1f} tok/s  {d['step_ms']:.3f} ms  fraction {d['fraction_of_floor']:.3f}")
for b in (1, 256):
    for n in ("moe_fp8", "moe_fp8_w8a8"):
        if b in r[n] and b in r["moe_bf16"]:
            print(f"{n} / bf16 at bs{b}: {r[n][b]['tok_per_s'] / r['moe_bf16'][b]['tok_per_s']:.3f}x")
PY
