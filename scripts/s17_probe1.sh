#!/usr/bin/env bash
# session 17 probe 1: MoE FP8 profiles (bs1, bs256) and the 30B FP8 GEMV tile sweep
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
[ -f .gguf/smol.part-aa ] && cp .gguf/smol.part-aa /tmp/
O=${OUT:-/tmp/o}; mkdir -p $O
step() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$(date +%s); timeout -k 5 $t "$@" > $O/$n.log 2>&1; echo "rc=$? $(( $(date +%s)-t0 ))s"; }
step prof_fp8_bs1 100 python3 -m minisgl.benchmark.moe --profile --profile-batch 1 --quantization fp8
step prof_bf16_bs1 90 python3 -m minisgl.benchmark.moe --profile --profile-batch 1
step prof_fp8_bs256 100 python3 -m minisgl.benchmark.moe --profile --profile-batch 256 --quantization fp8
step prof_bf16_bs256 90 python3 -m minisgl.benchmark.moe --profile --profile-batch 256
step gemv30b 100 python3 -m minisgl.benchmark.gemv --fp8 --quick --only 30b
for f in $O/*.log; do echo "#### $f"; grep -v "^{" $f | tail -40 | cut -c1-180; done
