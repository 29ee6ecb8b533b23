#!/usr/bin/env bash
# A/B runs of one switch on a GPU host: the GPU test suites once (switch at its default), then
# W2 (Llama-3-8B shape) and MoE decode (Qwen3-30B-A3B shape) with the switch's env var unset and
# set to 1, then W1 once; a short table last. Logs under $OUT.
#   OUT=/dir AB_VAR=MINISGL_DISABLE_PDL bash scripts/gpu_ab.sh
# SKIP: space-separated steps to leave out (tests w2 moe w1 w2_tp2).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
LOG=${OUT:-/tmp/minisgl-ab}
VAR=${AB_VAR:-MINISGL_DISABLE_PDL}
SKIP=${SKIP:-}
M=minisgl/benchmark/models
mkdir -p "$LOG"
step() {  # step NAME LIMIT CMD...
  local name=$1 limit=$2; shift 2
  for s in $SKIP; do [[ $name == "$s"* ]] && return; done
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$LOG/$name.log" 2>&1
  echo "== $name rc=$? $(( $(date +%s) - t0 ))s"; tail -n 4 "$LOG/$name.log" | cut -c1-220
}
step tests 300 $PY -m pytest -q tests/gpu/test_engine_gpu.py tests/gpu/test_attention_kernels_gpu.py tests/gpu/test_moe_gpu.py tests/kernels/test_moe_kernel.py tests/kernels/test_gemv.py -p no:cacheprovider -x
step w2_on 100 $PY -m minisgl.benchmark.latency --model $M/llama-3-8b --load-format dummy
step w2_off 100 env $VAR=1 $PY -m minisgl.benchmark.latency --model $M/llama-3-8b --load-format dummy
step moe_on 120 $PY -m minisgl.benchmark.moe --skip-kernels
step moe_off 120 env $VAR=1 $PY -m minisgl.benchmark.moe --skip-kernels
step w1 150 $PY -m minisgl.benchmark.offline --model $M/qwen3-0.6b --load-format dummy
if [[ $($PY -c "import torch; print(torch.cuda.device_count())") -ge 2 ]]; then
  step w2_tp2_on 120 $PY -m minisgl.benchmark.latency --model $M/llama-3-8b --load-format dummy --tp-size 2
fi
echo "== summary ($VAR)"
$PY - "$LOG" <<'PYEOF'
import json, sys
from pathlib import Path
for p in sorted(Path(sys.argv[1]).glob("*.log")):
    lines = [l for l in p.read_text(errors="replace").splitlines() if l.startswith("{")]
    if not lines:
        continue
    d = json.loads(lines[-1])
    keep = {k: d[k] for k in ("median_itl_ms", "itl_over_floor", "measured_s", "fraction_of_floor", "output_tok_per_s") if k in d}
    if isinstance(d.get("decode"), list):
        keep["decode"] = [(r.get("batch"), round(r.get("step_ms", 0), 3), round(r.get("fraction_of_floor", 0), 3)) for r in d["decode"]]
    print(p.stem, keep)
PYEOF
