#!/usr/bin/env bash
# W4 on a GPU host: the HTTP server on a config-only model (dummy weights, a synthetic tokenizer)
# under Poisson arrivals and at saturation, against the offline engine in the same run; then an
# abort storm against the same server. Logs under $OUT; a short table last.
#   OUT=/dir bash scripts/gpu_serving.sh      (MODEL, REQUESTS, RATES, CLIENTS to override)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
LOG=${OUT:-/tmp/minisgl-serving}
MODEL=${MODEL:-minisgl/benchmark/models/qwen3-0.6b}
REQUESTS=${REQUESTS:-256}
RATES=${RATES:-16,32,inf}
CLIENTS=${CLIENTS:-4}  # client processes: one Python client cannot parse the stream of a GPU
mkdir -p "$LOG"
SYN=$(mktemp -d)
$PY -c "import sys; from pathlib import Path; from minisgl.benchmark.serving import synthetic_tokenizer_model as s; print(s(sys.argv[1], Path(sys.argv[2])))" "$MODEL" "$SYN" > /dev/null
PORT=30017
$PY -m minisgl --model "$SYN" --load-format dummy --mem-fraction 0.42 --port $PORT --log-level warning > "$LOG/server.log" 2>&1 &
SERVER=$!
URL=http://127.0.0.1:$PORT
for _ in $(seq 600); do
  kill -0 $SERVER 2> /dev/null || { echo "the server exited"; tail -n 20 "$LOG/server.log"; exit 1; }
  curl -sf $URL/health > /dev/null && break; sleep 0.5
done
timeout 420 $PY -m minisgl.benchmark.serving --url $URL --model "$SYN" --load-format dummy \
  --num-requests "$REQUESTS" --prompt-len 100-1024 --output-len 100-1024 \
  --rates "$RATES" --repeats 2 --client-procs "$CLIENTS" > "$LOG/w4.log" 2>&1
echo "== w4 rc=$?"
# Which process limits the server at saturation: CPU per process during one saturated run.
$PY -m minisgl.benchmark.serving --url $URL --model "$SYN" --load-format dummy --skip-offline \
  --num-requests "$REQUESTS" --prompt-len 100-1024 --output-len 100-1024 --rates inf \
  --repeats 1 --client-procs "$CLIENTS" > "$LOG/w4_saturated.log" 2>&1 &
BENCH=$!
$PY scripts/proc_cpu.py --pid $SERVER --pid $BENCH --interval 0.25 > "$LOG/cpu.log" 2>&1 &
SAMPLER=$!
wait $BENCH; echo "== saturated run rc=$?"; kill $SAMPLER; wait $SAMPLER
timeout 120 $PY scripts/server_abort_check.py --url $URL > "$LOG/abort.log" 2>&1
echo "== abort check rc=$?"
kill $SERVER; wait $SERVER
echo "== server exit rc=$? (143 = SIGTERM)"; tail -n 5 "$LOG/server.log"
grep -v '^{' "$LOG/w4.log" | tail -n 12; grep -v '^{' "$LOG/cpu.log"
grep -v '^{' "$LOG/w4_saturated.log" | tail -n 3; tail -n 1 "$LOG/abort.log"
