#!/usr/bin/env bash
# L2 warming at batch 1 (`MINISGL_WARM_L2`, `minisgl.kernels.common.warm_ranges`) on one H200 in
# one device call: the GPU tests it touches (and the FP8 / speculative ones when the SmolLM2 GGUF
# is in place), then W2 (Llama-3-8B shape, batch-1 decode) with FP8 and bf16 weights at each
# warming budget "A,C" of WARM (MiB: A after the qkv GEMV, C after each other GEMV), and
# Qwen3-30B-A3B-shape MoE decode at batch 1 for each budget of MOE_WARM. A short table last.
#   OUT=/dir bash scripts/gpu_warm.sh
# Environment: PY, WARM ("0,0 40,8" ...), BF16_WARM, MOE_WARM (budgets; empty: skip),
# TESTS (0: skip the tests), BUDGET (seconds in all, default 540).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$(command -v python || command -v python3)}
LOG=${OUT:-/tmp/minisgl-warm}
WARM=${WARM-0,0 40,0 40,8 24,8 40,16}
BF16_WARM=${BF16_WARM-0,0 48,8}
MOE_WARM=${MOE_WARM-}
BUDGET=${BUDGET:-540}
M=minisgl/benchmark/models
START=$(date +%s)
mkdir -p "$LOG"

run() {  # run NAME LIMIT CMD...: CMD under a timeout (capped by the budget left), to NAME.log
  local name=$1 limit=$2
  shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if (( left < 20 )); then echo "== $name: skipped, ${left}s left"; return; fi
  (( limit > left )) && limit=$left
  echo "== $name (limit ${limit}s)"
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$LOG/$name.log" 2>&1
  echo "   rc=$? in $(( $(date +%s) - t0 ))s"; tail -n 2 "$LOG/$name.log" | cut -c1-200 | sed 's/^/   | /'
}

if [[ ${TESTS:-1} != 0 ]]; then
  run tests 240 "$PY" -m pytest -q -p no:cacheprovider -rfE -k "not compile" \
    tests/kernels/test_gemv.py tests/gpu/test_fp8_gpu.py tests/gpu/test_speculative_gpu.py \
    "tests/gpu/test_engine_gpu.py::test_batch_one_steps_match_reference"
fi
for w in $WARM; do
  MINISGL_WARM_L2=$w run "w2_fp8_${w/,/_}" 70 "$PY" -m minisgl.benchmark.latency \
    --model $M/llama-3-8b --load-format dummy --quantization fp8
done
for w in $BF16_WARM; do
  MINISGL_WARM_L2=$w run "w2_bf16_${w/,/_}" 70 "$PY" -m minisgl.benchmark.latency \
    --model $M/llama-3-8b --load-format dummy
done
for w in $MOE_WARM; do
  MINISGL_WARM_L2=$w run "moe_fp8_${w/,/_}" 100 "$PY" -m minisgl.benchmark.moe --skip-kernels \
    --decode-batches 1 --quantization fp8
done

"$PY" - "$LOG" << 'PY'
import json, sys
from pathlib import Path

def last_json(p):
    for line in reversed(p.read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None

for p in sorted(Path(sys.argv[1]).glob("*.log")):
    d = last_json(p)
    if not d:
        continue
    if "median_itl_ms" in d:
        print(f"{p.stem:16} median ITL {d['median_itl_ms']:.3f} ms  floor {d['floor_ms']:.3f}  "
              f"x{d['itl_over_floor']:.3f}")
    for r in d.get("decode", []):
        print(f"{p.stem:16} bs{r['batch']} {r['tok_per_s']:.1f} tok/s  {r['step_ms']:.3f} ms")
PY
