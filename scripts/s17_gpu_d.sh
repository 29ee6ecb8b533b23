#!/usr/bin/env bash
# session 17 device call D: decode tail blocks (tests, W1 kernel sweep, W1 FP8 in the engine)
# and W2 FP8 with other batch-1 split lengths.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
O=${OUT:-/tmp/o}; mkdir -p $O
step() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$(date +%s); timeout -k 5 $t "$@" > $O/$n.log 2>&1; echo "rc=$? $(( $(date +%s)-t0 ))s"; tail -${TAILN:-2} $O/$n.log | cut -c1-200; }
M=minisgl/benchmark/models
W2="minisgl.benchmark.latency --model $M/llama-3-8b --load-format dummy --quantization fp8"
W1="minisgl.benchmark.offline --model $M/qwen3-0.6b --load-format dummy --kv-cache-dtype fp8_e4m3"
step tests 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_attention_kernels.py -k "tail or decode"
step w1k_fp8 150 python3 -m minisgl.benchmark.kernels --kv-cache-dtype fp8_e4m3 --w1 --page-size 32
grep -E "^ *(200|80|48) " $O/w1k_fp8.log | sort -k10 -r | head -14
for f in "" min_split_tokens=128 min_split_tokens=256 min_split_tokens=4096; do
  step "w2_fp8_${f:-default}" 80 python3 scripts/decode_config_run.py "$f" $W2
  grep -E "median_itl_ms|itl_over_floor " $O/w2_fp8_${f:-default}.log
done
for f in "" tail_n=32; do
  step "w1_fp8_${f:-default}" 110 python3 scripts/decode_config_run.py "$f" $W1
  grep -E "output_tok_per_s|measured_s|fraction_of_floor" $O/w1_fp8_${f:-default}.log | head -3
done
