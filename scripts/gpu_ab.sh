#!/usr/bin/env bash
# A/B runs of one switch on a GPU host: the GPU test suites once with the switch set, then each
# benchmark with the switch unset ("off") and set ("on"), alternating; a short table last. Logs
# under $OUT.
#   OUT=/dir AB=MINISGL_DISABLE_PDL STEPS="tests w1" bash scripts/gpu_ab.sh
# A/B by commit: AB_TREE=DIR runs the "off" side from another tree (e.g. an older commit's,
# `git archive COMMIT | tar -x -C DIR`), the "on" side from this one, no switch set:
#   OUT=/dir AB_TREE=.ab/base STEPS="w2 w1" REPEAT=3 bash scripts/gpu_ab.sh
# AB: NAME=VALUE, or several separated by spaces (a bare NAME means NAME=1; AB_VAR is the
# older spelling of it).
# STEPS: which of tests w2 moe w1 w2_tp2 to run, in that order (default: all).
# REPEAT: off/on pairs per benchmark (default 1). ONLY_ON=1: no "off" runs (a baseline that
# another A/B of the same call has measured).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
LOG=$(mkdir -p "${OUT:-/tmp/minisgl-ab}" && cd "${OUT:-/tmp/minisgl-ab}" && pwd)
AB_TREE=${AB_TREE:-}
if [[ -n $AB_TREE ]]; then
  AB_TREE=$(cd "$AB_TREE" && pwd)
  AB=${AB:-}
else
  AB=${AB:-${AB_VAR:-MINISGL_DISABLE_PDL}}
  [[ $AB == *=* ]] || AB="$AB=1"
fi
STEPS=${STEPS:-tests w2 moe w1 w2_tp2}
REPEAT=${REPEAT:-1}
M=minisgl/benchmark/models
mkdir -p "$LOG"
wants() { [[ " $STEPS " == *" $1 "* ]]; }
step() {  # step NAME LIMIT CMD...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$LOG/$name.log" 2>&1
  echo "== $name rc=$? $(( $(date +%s) - t0 ))s"; tail -n 4 "$LOG/$name.log" | cut -c1-220
}
off() {  # off NAME LIMIT CMD...: the "off" side (in AB_TREE when given)
  if [[ -n $AB_TREE ]]; then
    (cd "$AB_TREE" && export PYTHONPATH=$AB_TREE && step "$@")
  else
    step "$@"
  fi
}
ab() {  # ab NAME LIMIT CMD...: CMD without and with the switch, REPEAT times
  local name=$1 limit=$2; shift 2
  for i in $(seq "$REPEAT"); do
    [[ ${ONLY_ON:-0} == 1 ]] || off "${name}_off$i" "$limit" "$@"
    step "${name}_on$i" "$limit" env $AB "$@"
  done
}
if wants tests; then
  step tests 300 env $AB $PY -m pytest -q tests/gpu/test_engine_gpu.py \
    tests/gpu/test_attention_kernels_gpu.py tests/gpu/test_moe_gpu.py \
    tests/kernels/test_moe_kernel.py tests/kernels/test_gemv.py -p no:cacheprovider -x
fi
wants w2 && ab w2 100 $PY -m minisgl.benchmark.latency --model $M/llama-3-8b --load-format dummy
wants moe && ab moe 120 $PY -m minisgl.benchmark.moe --skip-kernels
wants w1 && ab w1 150 $PY -m minisgl.benchmark.offline --model $M/qwen3-0.6b --load-format dummy
if wants w2_tp2 && [[ $($PY -c "import torch; print(torch.cuda.device_count())") -ge 2 ]]; then
  ab w2_tp2 120 $PY -m minisgl.benchmark.latency --model $M/llama-3-8b --load-format dummy \
    --tp-size 2
fi
echo "== summary (on: $AB)"
$PY - "$LOG" <<'PYEOF'
import json, sys
from pathlib import Path
for p in sorted(Path(sys.argv[1]).glob("*.log")):
    lines = [l for l in p.read_text(errors="replace").splitlines() if l.startswith("{")]
    if not lines:
        continue
    d = json.loads(lines[-1])
    keys = ("median_itl_ms", "itl_over_floor", "measured_s", "fraction_of_floor", "output_tok_per_s")
    keep = {k: d[k] for k in keys if k in d}
    if isinstance(d.get("decode"), list):
        keep["decode"] = [(r.get("batch"), round(r.get("step_ms", 0), 3), round(r.get("fraction_of_floor", 0), 3)) for r in d["decode"]]
    if isinstance(d.get("steps"), list):
        keep["steps_ms"] = {r["kind"]: round(r["step_ms"], 2) for r in d["steps"]}
    print(p.stem, keep)
# Per benchmark and side: the median over its runs, the first run of each side dropped when
# there are several (a call's first run of a benchmark is a few percent slow).
import re, statistics
groups = {}
for p in sorted(Path(sys.argv[1]).glob("*.log")):
    m = re.fullmatch(r"(.+)_(off|on)(\d+)", p.stem)
    lines = [l for l in p.read_text(errors="replace").splitlines() if l.startswith("{")]
    if not m or not lines:
        continue
    d = json.loads(lines[-1])
    for key in ("median_itl_ms", "measured_s", "output_tok_per_s"):
        if key in d:
            groups.setdefault((m[1], key), {}).setdefault(m[2], []).append((int(m[3]), d[key]))
for (name, key), sides in sorted(groups.items()):
    med = {}
    for side, runs in sides.items():
        vals = [v for i, v in sorted(runs)]
        med[side] = statistics.median(vals[1:] if len(vals) > 1 else vals)
    ratio = med["on"] / med["off"] if "on" in med and "off" in med else float("nan")
    print(f"{name} {key}: off {med.get('off')} on {med.get('on')} on/off {ratio:.4f}")
PYEOF
