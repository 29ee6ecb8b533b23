#!/usr/bin/env bash
# One GPU session: the GPU test suite, then the benchmarks (W1, W2, W3, MoE, W1 vs transformers),
# each under a timeout and all within a total budget; full logs under $OUT (or LOG_DIR), a short
# summary table last. Run from anywhere:  OUT=/some/dir bash scripts/gpu_check.sh
#
# Environment: PY (python to use), GPU_CHECK_BUDGET (seconds for everything, default 540),
# SKIP (space-separated step names to skip: tests w1 w2 kernels moe allreduce tp_tokens w2_tp2 hf;
# the three tensor-parallel steps run only with 2+ GPUs).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-$(command -v python || command -v python3)}
LOG_DIR=${OUT:-${LOG_DIR:-/tmp/minisgl-gpu-check}}
BUDGET=${GPU_CHECK_BUDGET:-540}
SKIP=${SKIP:-}
mkdir -p "$LOG_DIR"
START=$(date +%s)
STATUS_FILE="$LOG_DIR/status.tsv"
: > "$STATUS_FILE"

# run NAME LIMIT_S CMD...: run CMD with a timeout (capped by the budget left), log to NAME.log
run() {
  local name=$1 limit=$2
  shift 2
  if [[ " $SKIP " == *" $name "* ]]; then
    printf '%s\tskipped\t0\n' "$name" >> "$STATUS_FILE"
    return
  fi
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if (( left < 20 )); then
    echo "== $name: skipped, ${left}s of the budget left"
    printf '%s\tno-time\t0\n' "$name" >> "$STATUS_FILE"
    return
  fi
  (( limit > left )) && limit=$left
  echo "== $name (limit ${limit}s): $*"
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$LOG_DIR/$name.log" 2>&1
  local rc=$?
  local dt=$(( $(date +%s) - t0 ))
  echo "   rc=$rc in ${dt}s; last lines:"
  tail -n 6 "$LOG_DIR/$name.log" | cut -c1-200 | sed 's/^/   | /'
  printf '%s\t%s\t%s\n' "$name" "$rc" "$dt" >> "$STATUS_FILE"
}

{
  echo "python: $PY"
  "$PY" -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO GPU')"
  "$PY" -c "import triton; print('triton', triton.__version__)" 2>&1
  "$PY" -c "import transformers; print('transformers', transformers.__version__)" 2>&1
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
} 2>&1 | tee "$LOG_DIR/env.log"

M=minisgl/benchmark/models
if "$PY" -c "import pytest" 2> /dev/null; then
  run tests 300 "$PY" -m pytest tests/gpu tests/kernels/test_gemv.py tests/kernels/test_moe_kernel.py \
    -v -p no:cacheprovider -rfE --durations=15
else
  echo "(pytest is not installed: running tests/gpu/test_engine_gpu.py with its own runner)"
  run tests 210 "$PY" tests/gpu/test_engine_gpu.py
fi
run w1 150 "$PY" -m minisgl.benchmark.offline --model $M/qwen3-0.6b --load-format dummy
run w2 100 "$PY" -m minisgl.benchmark.latency --model $M/llama-3-8b --load-format dummy
run kernels 90 "$PY" -m minisgl.benchmark.kernels
if [[ -f minisgl/benchmark/moe.py ]]; then
  run moe 100 "$PY" -m minisgl.benchmark.moe
fi
if [[ $("$PY" -c "import torch; print(torch.cuda.device_count())" 2> /dev/null) -ge 2 ]]; then
  run allreduce 120 "$PY" scripts/allreduce_check.py
  run tp_tokens 150 "$PY" scripts/tp_tokens.py --tp-size 2
  run w2_tp2 120 "$PY" -m minisgl.benchmark.latency --model $M/llama-3-8b --load-format dummy \
    --tp-size 2
fi
run hf 170 "$PY" -m minisgl.benchmark.offline --model $M/qwen3-0.6b --load-format dummy \
  --engine hf --hf-requests 32 --hf-timeout 100

echo
echo "== summary (logs in $LOG_DIR, total $(( $(date +%s) - START ))s)"
"$PY" - "$LOG_DIR" << 'EOF'
import json, re, sys
from pathlib import Path

log_dir = Path(sys.argv[1])
status = {}
for line in (log_dir / "status.tsv").read_text().splitlines():
    name, rc, secs = line.split("\t")
    status[name] = (rc, secs)

def last_json(name):
    path = log_dir / f"{name}.log"
    if not path.exists():
        return None
    for line in reversed(path.read_text(errors="replace").splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None

def f(v, nd=3):
    return f"{v:.{nd}g}" if isinstance(v, float) else str(v)

rows = []
for name, (rc, secs) in status.items():
    rows.append((name, f"rc={rc}", f"{secs}s", ""))
tests = (log_dir / "tests.log")
if tests.exists():
    text = tests.read_text(errors="replace")
    verdicts = re.findall(r"::(\S+) (PASSED|FAILED|ERROR|SKIPPED)", text)
    verdicts += [(n, "PASSED" if v == "PASS" else "FAILED") for v, n in re.findall(r"^(PASS|FAIL) (\S+)", text, re.M)]
    tally = {}
    for _, v in verdicts:
        tally[v] = tally.get(v, 0) + 1
    rows.append(("tests", "", "", ", ".join(f"{n} {k.lower()}" for k, n in tally.items()) or "no results"))
    rows += [("  FAILED", "", "", n[:110]) for n, v in verdicts if v in ("FAILED", "ERROR")][:15]
w1 = last_json("w1")
if w1:
    rows.append(("W1", f"{f(w1.get('output_tok_per_s'), 5)} tok/s", f"{f(w1.get('measured_s'))} s",
                 f"floor {f(w1.get('floor_s'))} s, fraction_of_floor {f(w1.get('fraction_of_floor'))}, "
                 f"bw {f(w1.get('bandwidth_bytes_per_s', 0) / 1e12)} TB/s, target >= 0.75"))
    for s in w1.get("steps", []):
        rows.append(("  W1 " + s["kind"], f"{s['steps']} steps", f"{f(s['step_ms'])} ms",
                     f"floor {f(s['floor_ms'])} ms, fraction {f(s['fraction_of_floor'])}, batch {f(s['mean_batch'])}"))
w2 = last_json("w2")
if w2:
    rows.append(("W2", f"median {f(w2.get('median_itl_ms'))} ms", f"p99 {f(w2.get('p99_itl_ms'))} ms",
                 f"floor {f(w2.get('floor_ms'))} ms, itl/floor {f(w2.get('itl_over_floor'))} (target <= 1.10), "
                 f"all-params floor {f(w2.get('floor_all_params_ms'))} ms"))
hf = last_json("hf")
if hf:
    rows.append(("W1 vs HF", f"{f(hf.get('output_tok_per_s'), 5)} tok/s", f"HF {f(hf.get('hf_output_tok_per_s'), 4)} tok/s",
                 f"ratio {f(hf.get('minisgl_over_hf'))} on {hf.get('requests')} requests, HF complete {hf.get('hf_complete')} "
                 f"{hf.get('hf_error', '')}"))
w3 = last_json("kernels")
if w3:
    for r in w3.get("decode", []):
        if r.get("batch") == 256:
            rows.append((f"W3 decode 256x{r.get('context')}", f"{f(r.get('time_us'))} us", "",
                         f"fraction_of_copy {f(r.get('fraction_of_copy'))} (target >= 0.85), rel_err {f(r.get('rel_err'))}"))
moe = last_json("moe")
if moe:
    for r in moe.get("decode", []) if isinstance(moe.get("decode"), list) else []:
        rows.append((f"MoE decode bs{r.get('batch')}", f"{f(r.get('tok_per_s'), 5)} tok/s", f"{f(r.get('step_ms'))} ms",
                     f"fraction_of_floor {f(r.get('fraction_of_floor'))}"))
w = [max(len(r[i]) for r in rows) for i in range(3)]
for r in rows:
    print("  ".join(c.ljust(w[i]) for i, c in enumerate(r[:3])) + "  " + r[3])
EOF
