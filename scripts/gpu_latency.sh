#!/usr/bin/env bash
# Issue 23 on a GPU host (W4 shape: dummy Qwen3-0.6B, synthetic tokenizer): the latency target
# (--itl-target-ms auto) against the old policy (0) on the same requests, at 16 req/s and at
# saturation, with the offline engine as the throughput reference; two priority classes at
# saturation; and again with a KV pool too small for every request (retraction). Inter-token
# latency from the server's own token times; every request's token times saved for plots.
#   OUT=/dir bash scripts/gpu_latency.sh      (MODEL, REQUESTS, RATES, CLIENTS, PAGES, RUNNING, PARTS, REPEATS, TARGETS to override)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
LOG=${OUT:-/tmp/minisgl-latency}
MODEL=${MODEL:-minisgl/benchmark/models/qwen3-0.6b}
REQUESTS=${REQUESTS:-256}
RATES=${RATES:-16,inf}
CLIENTS=${CLIENTS:-8}  # a client process builds its burst one request at a time: 32 each, not 64
PAGES=${PAGES:-2000}  # 64k tokens at page size 32: about 60 W4 requests at once
RUNNING=${RUNNING:-64}
PARTS=${PARTS:-policies classes small_pool}
REPEATS=${REPEATS:-2}
TARGETS=${TARGETS:-auto,0}
mkdir -p "$LOG"
W4=(--model "$MODEL" --load-format dummy --mem-fraction 0.42 --num-requests "$REQUESTS"
    --prompt-len 100-1024 --output-len 100-1024 --client-procs "$CLIENTS")
run() {  # name, then the benchmark's other flags
  local name=$1; shift
  [[ " $PARTS " == *" $name "* ]] || return 0
  timeout 1200 $PY -m minisgl.benchmark.serving "${W4[@]}" --server-log "$LOG/$name.server.log" \
    --token-times-out "$LOG/$name.times.json" "$@" > "$LOG/$name.log" 2>&1
  echo "== $name rc=$?"
}
run policies --rates "$RATES" --repeats "$REPEATS" --itl-targets "$TARGETS"
# With a pool for all 256 requests every one is admitted as it arrives (no queue for priorities
# to order): the server is held to RUNNING requests at once, so that a queue forms.
run classes --skip-offline --rates inf --repeats 1 --priority-classes 0,1 \
  --server-args "--max-running-requests $RUNNING"
run small_pool --skip-offline --rates inf --repeats 1 --priority-classes 0,1 \
  --server-args "--num-pages $PAGES"
for name in $PARTS; do
  echo "== $name"; grep -v '^{' "$LOG/$name.log" | tail -n 24
done
