#!/usr/bin/env bash
# session 17 device call B: W1's decode attention replayed on the engine's own inputs (FP8 and
# bf16 KV), the kernel benchmark's synthetic ragged batches, W2 FP8 with the persistent tiles.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
O=${OUT:-/tmp/o}; mkdir -p $O
step() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$(date +%s); timeout -k 5 $t "$@" > $O/$n.log 2>&1; echo "rc=$? $(( $(date +%s)-t0 ))s"; tail -12 $O/$n.log | cut -c1-200; }
M=minisgl/benchmark/models
step replay_fp8 150 python3 scripts/w1_attention_replay.py --kv-cache-dtype fp8_e4m3
step replay_bf16 150 python3 scripts/w1_attention_replay.py
step w2_fp8 80 python3 -m minisgl.benchmark.latency --model $M/llama-3-8b --load-format dummy --quantization fp8
step w1k_fp8 120 python3 -m minisgl.benchmark.kernels --kv-cache-dtype fp8_e4m3 --w1 --page-size 32
grep -E "^ *(200|80|48) " $O/w1k_fp8.log | sort -k9 -r | head -12
