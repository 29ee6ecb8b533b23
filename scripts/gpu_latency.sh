#!/usr/bin/env bash
# Issue 23 on a GPU host (W4 shape: dummy Qwen3-0.6B, synthetic tokenizer): the latency target
# (--itl-target-ms auto) against the old policy (0) on the same requests, at 16 req/s and at
# saturation, with the offline engine as the throughput reference; two priority classes at
# saturation; and again with a KV pool too small for every request (retraction). Inter-token
# latency from the server's own token times; every request's token times saved for plots.
#   OUT=/dir bash scripts/gpu_latency.sh      (MODEL, REQUESTS, RATES, CLIENTS, PAGES to override)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
LOG=${OUT:-/tmp/minisgl-latency}
MODEL=${MODEL:-minisgl/benchmark/models/qwen3-0.6b}
REQUESTS=${REQUESTS:-256}
RATES=${RATES:-16,inf}
CLIENTS=${CLIENTS:-4}
PAGES=${PAGES:-2000}  # 64k tokens at page size 32: about 60 W4 requests at once
mkdir -p "$LOG"
W4=(--model "$MODEL" --load-format dummy --mem-fraction 0.42 --num-requests "$REQUESTS"
    --prompt-len 100-1024 --output-len 100-1024 --client-procs "$CLIENTS")
run() {  # name, then the benchmark's other flags
  local name=$1; shift
  timeout 1200 $PY -m minisgl.benchmark.serving "${W4[@]}" --server-log "$LOG/$name.server.log" \
    --token-times-out "$LOG/$name.times.json" "$@" > "$LOG/$name.log" 2>&1
  echo "== $name rc=$?"
}
run policies --rates "$RATES" --repeats 2 --itl-targets auto,0
run classes --skip-offline --rates inf --repeats 1 --priority-classes 0,1
run small_pool --skip-offline --rates inf --repeats 1 --priority-classes 0,1 \
  --server-args "--num-pages $PAGES"
for name in policies classes small_pool; do
  echo "== $name"; grep -v '^{' "$LOG/$name.log" | tail -n 24
done
