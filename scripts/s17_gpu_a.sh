#!/usr/bin/env bash
# session 17 device call A: GPU gemv tests, the FP8 GEMV sweep with the persistent grid
# (8b + 30b shapes), W2 bf16 / FP8 with today's table.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
O=${OUT:-/tmp/o}; mkdir -p $O
step() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$(date +%s); timeout -k 5 $t "$@" > $O/$n.log 2>&1; echo "rc=$? $(( $(date +%s)-t0 ))s"; tail -3 $O/$n.log | cut -c1-200; }
M=minisgl/benchmark/models
step tests 150 python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_gemv.py -k "not compile"
step sweep 200 python3 -m minisgl.benchmark.gemv --fp8 --quick --only 8b,30b
step w2_fp8 80 python3 -m minisgl.benchmark.latency --model $M/llama-3-8b --load-format dummy --quantization fp8
step w2_bf16 80 python3 -m minisgl.benchmark.latency --model $M/llama-3-8b --load-format dummy
grep -v "^{" $O/sweep.log | tail -30 | cut -c1-250
