#!/usr/bin/env bash
# W4 on a GPU, in one device call: the HTTP server on a config-only model (dummy weights, a
# synthetic tokenizer) streaming to CLIENTS client processes, against the offline engine on the
# same requests; every request's server token times saved under $OUT, and the ITL and TTFT
# plots drawn there (NAME.png; needs matplotlib). A summary last.
#   OUT=/dir bash scripts/gpu_serving.sh
# STEPS (default "w4 abort"), any of:
#   w4          Poisson arrivals at RATES (default 16,inf) with each latency target of TARGETS
#               (default auto; "auto,0" compares it with the token limit alone, a server each)
#   classes     two priority classes at saturation, the server held to 64 running requests
#   small_pool  the same with a KV pool too small for every request (retraction)
#   abort       a server of our own: each server process's CPU during a saturated run, then 128
#               streams of which every other one is cancelled mid-way; the server must hold
#               nothing afterwards, keep serving and exit cleanly on SIGTERM
# MODEL, REQUESTS (256), CLIENTS (8) to override; BUDGET (default 570 s).
STEPS=${STEPS:-w4 abort}
BUDGET=${BUDGET:-570}
source "$(dirname "$0")/lib.sh"
MODEL=${MODEL:-$M/qwen3-0.6b}
W4="--load-format dummy --num-requests ${REQUESTS:-256} --prompt-len 100-1024 --output-len 100-1024
  --client-procs ${CLIENTS:-8}"

serving() {  # serving NAME FLAGS...: the benchmark with its own server
  local name=$1
  shift
  run_step "$name" 300 "$PY" -m minisgl.benchmark.serving --model "$MODEL" $W4 --mem-fraction 0.42 \
    --server-log "$OUT/$name.server.log" --token-times-out "$OUT/$name.times.json" \
    --plot "$OUT/$name.png" "$@"
}

cpu_ticks() {  # pid, name and CPU ticks of the server process and its workers
  local p
  for p in $1 $(pgrep -P "$1"); do
    [[ -r /proc/$p/stat ]] && awk -v p="$p" '{print p, $2, $14 + $15}' "/proc/$p/stat"
  done
}

abort_check() {  # a server of our own for the CPU sample and the abort check
  local syn port=30017 server t0 rc
  syn=$(mktemp -d)
  "$PY" -c "import sys; from pathlib import Path; from minisgl.benchmark.serving import \
synthetic_tokenizer_model as s; s(sys.argv[1], Path(sys.argv[2]))" "$MODEL" "$syn" || return 1
  "$PY" -m minisgl --model "$syn" --load-format dummy --mem-fraction 0.42 --port $port \
    --log-level warning > "$OUT/abort.server.log" 2>&1 &
  server=$!
  for _ in $(seq 600); do
    kill -0 $server 2> /dev/null || { echo "the server exited"; return 1; }
    curl -sf http://127.0.0.1:$port/health > /dev/null && break
    sleep 0.5
  done
  cpu_ticks $server > "$OUT/cpu.before"
  t0=$(date +%s%N)
  "$PY" -m minisgl.benchmark.serving --url http://127.0.0.1:$port --model "$syn" $W4 \
    --skip-offline --rates inf --repeats 1 > "$OUT/abort.saturated.log" 2>&1
  echo "CPU of each server process over a saturated run (% of one core):"
  join <(cpu_ticks $server | sort) <(sort "$OUT/cpu.before") | awk -v t0="$t0" \
    -v t1="$(date +%s%N)" -v tick="$(getconf CLK_TCK)" \
    '{printf "  %-16s %3.0f%%\n", $2, 1e11 * ($3 - $5) / tick / (t1 - t0)}'
  "$PY" scripts/server_abort_check.py --url http://127.0.0.1:$port
  rc=$?
  kill $server
  wait $server
  echo "server exit status $? (0: a clean shutdown); check rc=$rc"
  return $rc
}

env_info
serving w4 --rates "${RATES:-16,inf}" --repeats 2 --itl-targets "${TARGETS:-auto}"
# With a pool for all 256 requests every one is admitted as it arrives (no queue to order).
serving classes --skip-offline --rates inf --repeats 1 --priority-classes 0,1 \
  --server-args "--max-running-requests 64"
serving small_pool --skip-offline --rates inf --repeats 1 --priority-classes 0,1 \
  --server-args "--num-pages 2000"
export PY OUT MODEL W4
export -f abort_check cpu_ticks
TAIL=12 run_step abort 300 bash -c abort_check
summary
