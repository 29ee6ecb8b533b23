#!/usr/bin/env bash
# session 17 device call C: the persistent decode grid on W1's ragged batches (kernel benchmark
# and the engine's own inputs), FP8 KV; the decode kernel tests on the GPU.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
O=${OUT:-/tmp/o}; mkdir -p $O
step() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$(date +%s); timeout -k 5 $t "$@" > $O/$n.log 2>&1; echo "rc=$? $(( $(date +%s)-t0 ))s"; tail -${TAILN:-3} $O/$n.log | cut -c1-200; }
step tests 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_attention_kernels.py -k "persistent or decode"
TAILN=22 step replay_fp8 150 python3 scripts/w1_attention_replay.py --kv-cache-dtype fp8_e4m3
step w1k_fp8 150 python3 -m minisgl.benchmark.kernels --kv-cache-dtype fp8_e4m3 --w1 --page-size 32
grep -E "^ *(200|80|48) " $O/w1k_fp8.log | sort -k11 -r | head -24
