#!/usr/bin/env bash
# Batch-1 MoE decode with FP8 experts in one launch (`_one_row_experts_fp8_kernel`) on one H200,
# one device call: the kernel tests, then Qwen3-30B-A3B-shape decode at batch 1 with FP8 experts
# (one launch at each tile pair of TILES, and the two-launch pair kernels) and bf16, a profile
# of the one-launch step; a short table last.   OUT=/dir bash scripts/gpu_moe1.sh
set -u
cd "$(dirname "$0")/.."
if [[ -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
  export PYTHONPATH=/tmp/site:$PWD
fi
O=${OUT:-/tmp/o}; mkdir -p "$O"
step() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$(date +%s); timeout -k 5 "$t" "$@" > "$O/$n.log" 2>&1; echo "rc=$? $(( $(date +%s)-t0 ))s"; tail -"${TAILN:-3}" "$O/$n.log" | cut -c1-220; }
MOE="python3 -m minisgl.benchmark.moe --skip-kernels --decode-batches 1"
TAILN=6 step tests 150 python3 -m pytest -q -p no:cacheprovider -rfE -x tests/kernels/test_moe_kernel.py tests/gpu/test_fp8_gpu.py -k "one_launch or route_ranks or one_row or pair or fp8_moe"
for t in ${TILES:-1}; do
  MINISGL_MOE_ONE_LAUNCH=$t step "fp8_one_$t" 80 $MOE --quantization fp8
done
MINISGL_MOE_ONE_LAUNCH=0 step fp8_two 80 $MOE --quantization fp8
step bf16 80 $MOE
[[ ${PROFILE:-1} == 1 ]] && TAILN=25 step profile 90 python3 -m minisgl.benchmark.moe --profile --profile-batch 1 --quantization fp8
for f in "$O"/fp8_one_*.log "$O"/fp8_two.log "$O"/bf16.log; do
  grep -h '"decode"' "$f" | python3 -c "
import json, sys
for l in sys.stdin:
    x = json.loads(l)['decode'][0]
    print('%-16s' % '$(basename $f .log)', x['batch'], round(x['tok_per_s'], 1), 'tok/s', round(x['step_ms'], 3), 'ms')
"
done
