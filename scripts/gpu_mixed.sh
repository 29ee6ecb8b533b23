#!/usr/bin/env bash
# Issue 23 on a GPU host: the mixed-step attention kernel's tests and benchmark, then W4's mixed
# steps (gpu_profile.py --parts w4mix) with piecewise graphs and with whole-step graphs.
#   OUT=/dir bash scripts/gpu_mixed.sh      (PARTS to choose: tests bench profile tune)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
LOG=${OUT:-/tmp/minisgl-mixed}
PARTS=${PARTS:-tests bench profile}
mkdir -p "$LOG"
t() {  # name, time limit, command...
  local n=$1 l=$2; shift 2
  [[ " $PARTS " == *" ${n%%_*} "* ]] || return 0
  local s; s=$(date +%s)
  timeout "$l" "$@" > "$LOG/$n.log" 2>&1
  echo "== $n rc=$? $(( $(date +%s) - s ))s"
  grep -v '^{' "$LOG/$n.log" | tail -n "${TAIL:-16}"
}
t tests 300 $PY -m pytest -q -x -p no:cacheprovider tests/kernels/test_mixed_attention.py \
  tests/kernels/test_mixed_attention_compile.py \
  "tests/gpu/test_engine_gpu.py::test_piecewise_graph_steps_match_reference"
t bench 120 $PY -m minisgl.benchmark.kernels --mixed
t bench_p1 120 $PY -m minisgl.benchmark.kernels --mixed --page-size 1
t bench_fp8 120 $PY -m minisgl.benchmark.kernels --mixed --kv-cache-dtype fp8_e4m3
t profile 180 $PY scripts/gpu_profile.py --parts w4mix
t profile_whole 180 $PY scripts/gpu_profile.py --parts w4mix --whole-step
t tune 420 $PY -m minisgl.benchmark.kernels --mixed --tune
