#!/usr/bin/env bash
# First measurements of the experiments that are off by default, in device calls of at most
# 8 minutes each; logs under $OUT, a summary per A/B last.
#   OUT=/dir bash scripts/gpu_experiments.sh 1   # GPU tests; W1 without the two-stream decode
#                                                # and with it (modes priority, chain)
#   OUT=/dir bash scripts/gpu_experiments.sh 2   # the kernel tests part 1 left; the batch GEMM:
#                                                # probe, W1 with it; decode split counts
#   OUT=/dir bash scripts/gpu_experiments.sh 3   # decode GEMM formulations; W1's prefill chunk
set -uo pipefail
cd "$(dirname "$0")/.."
export PY=${PY:-python3}
LOG=${OUT:-/tmp/minisgl-experiments}
PART=${1:-1}
mkdir -p "$LOG"
probe() {  # probe NAME LIMIT CMD...: a probe's output, its last lines shown
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$LOG/$name.log" 2>&1
  echo "== $name rc=$? $(( $(date +%s) - t0 ))s"; tail -n 14 "$LOG/$name.log" | cut -c1-200
}
case $PART in
  1)
    probe tests 330 "$PY" -m pytest -q -p no:cacheprovider -x tests/gpu tests/kernels/test_gemv.py \
      tests/kernels/test_moe_kernel.py tests/kernels/test_attention_kernels.py \
      tests/kernels/test_fused.py tests/engine/test_sample_kernel.py
    OUT=$LOG/two_stream AB=MINISGL_TWO_STREAM_DECODE_MIN_BS=64 STEPS="w1" bash scripts/gpu_ab.sh \
      | sed -n '/^== summary/,$p'
    OUT=$LOG/two_stream_chain STEPS="w1" ONLY_ON=1 \
      AB="MINISGL_TWO_STREAM_DECODE_MIN_BS=64 MINISGL_TWO_STREAM_MODE=chain" \
      bash scripts/gpu_ab.sh | sed -n '/^== summary/,$p'
    ;;
  2)
    # The test files part 1's 330 s did not reach, the batch GEMM (probe, then W1 with it) and
    # the decode split counts on W1-like ragged batches (W1's page size).
    probe tests_rest 160 "$PY" -m pytest -q -p no:cacheprovider -x --durations=8 \
      tests/kernels/test_attention_kernels.py tests/kernels/test_fused.py \
      tests/engine/test_sample_kernel.py tests/kernels/test_gemv.py tests/kernels/test_moe_kernel.py
    probe rows_gemm_probe 150 "$PY" scripts/rows_gemm_probe.py --quick --rows 8,64,214
    OUT=$LOG/rows_gemm AB=MINISGL_ROWS_GEMM_MAX_ROWS=256 STEPS="w1" ONLY_ON=1 \
      bash scripts/gpu_ab.sh | sed -n '/^== summary/,$p'
    probe decode_splits 140 "$PY" -m minisgl.benchmark.kernels --w1 --page-size 32
    ;;
  3)
    # Ways to call the decode step's GEMMs; W1 with smaller and larger prefill chunks.
    probe decode_gemm_probe 150 "$PY" scripts/decode_gemm_probe.py
    for tokens in 4096 16384; do
      probe "w1_prefill_$tokens" 100 "$PY" -m minisgl.benchmark.offline \
        --model minisgl/benchmark/models/qwen3-0.6b --load-format dummy --max-prefill-tokens "$tokens"
    done
    ;;
  *)
    echo "usage: $0 1|2" >&2
    exit 2
    ;;
esac
