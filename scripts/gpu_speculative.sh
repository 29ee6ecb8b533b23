#!/usr/bin/env bash
# Issue 22 on a GPU host: the speculative decoding GPU test, then the benchmark with the real
# SmolLM2 (copy-heavy, chat, 64 concurrent; n-gram and layer-skip draft), and the cost of a
# verify step of K = 4 drafts against a plain decode step on W2's Llama-3-8B shape (dummy).
#   OUT=/dir bash scripts/gpu_speculative.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
LOG=${OUT:-/tmp/minisgl-speculative}
mkdir -p "$LOG"
run() {  # name, then the command
  local name=$1; shift
  timeout 1200 "$@" > "$LOG/$name.log" 2>&1
  echo "== $name rc=$?"; grep -v '^{' "$LOG/$name.log" | tail -n 16
}
run gpu_test $PY -m pytest -q -p no:cacheprovider tests/gpu/test_speculative_gpu.py
run ngram $PY -m minisgl.benchmark.speculative --algorithm ngram --concurrency 64
run draft $PY -m minisgl.benchmark.speculative --algorithm draft --draft-layers 10 \
  --concurrency 64
run verify_cost $PY -m minisgl.benchmark.speculative --workloads none --verify-cost \
  --model minisgl/benchmark/models/llama-3-8b --load-format dummy --context 128
