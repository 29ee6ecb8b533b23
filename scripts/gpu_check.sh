#!/usr/bin/env bash
# The GPU check, in one device call: the GPU tests, then the engine benchmarks; a summary last.
#   OUT=/dir bash scripts/gpu_check.sh
#   OUT=/dir STEPS="w1 w1_fp8 w3_fp8 moe moe_fp8 accuracy" bash scripts/gpu_check.sh   # FP8
# STEPS (default "tests w1 w2 w2_fp8 w3"), any of: tests (TESTS, default tests/gpu; XDIST, pytest-xdist
# flags), w1, w1_fp8 (an FP8 KV cache), w1_det and w2_det (--deterministic, this tree only),
# w1_int4, w2, w2_fp8 (FP8 weights), w2_int4 (int4 weights), w2_tp2 (2+ GPUs), w3, w3_fp8 (an e4m3
# pool), moe, moe_fp8 (FP8 experts), accuracy (FP8 perplexity and KL; ACC_MODEL, default the
# embedded SmolLM2), hf (W1 against transformers), spec (W8 with SmolLM2, K = 15), verify (W8's
# verify step on W2's shape), structured (W9; TOKENIZER=a tokenizer GGUF such as
# ggml-vocab-qwen2.gguf), w10 (multi-turn with the KV host tier), profile (scripts/gpu_profile.py:
# where W1's and W2's step time goes).
# A/B, every benchmark run REPEAT times (default 1) on each side, alternating:
#   BASE=DIR   the other side runs from another tree (git archive COMMIT | tar -x -C DIR)
#   AB="NAME=VALUE ..."   the other side runs with these variables set (e.g. MINISGL_DISABLE_PDL=1)
# BUDGET: seconds for every step (default 570).
STEPS=${STEPS:-tests w1 w2 w2_fp8 w3}
BUDGET=${BUDGET:-570}
BASE=${BASE:+$(cd "$BASE" && pwd)}
source "$(dirname "$0")/lib.sh"
AB=${AB:-}

bench() {  # bench NAME LIMIT_S CMD...: CMD on this tree, and on the other side when A/B
  local name=$1 limit=$2 i
  shift 2
  if [[ -z $BASE && -z $AB ]]; then
    run_step "$name" "$limit" "$@"
    return
  fi
  for i in $(seq "${REPEAT:-1}"); do
    if [[ -n $BASE ]]; then
      (cd "$BASE" && PYTHONPATH=$BASE${PYTHONPATH:+:$PYTHONPATH} run_step "$name.base$i" "$limit" "$@")
    else
      run_step "$name.ab$i" "$limit" env $AB "$@"
    fi
    run_step "$name.this$i" "$limit" "$@"
  done
}

env_info
B="$PY -m minisgl.benchmark"
run_step tests 300 "$PY" -m pytest -q ${XDIST:-} -p no:cacheprovider -rfE ${TESTS:-tests/gpu}
bench w1 150 $B.offline --model $M/qwen3-0.6b --load-format dummy
bench w1_fp8 150 $B.offline --model $M/qwen3-0.6b --load-format dummy --kv-cache-dtype fp8_e4m3
run_step w1_det 150 $B.offline --model $M/qwen3-0.6b --load-format dummy --deterministic
bench w1_int4 150 $B.offline --model $M/qwen3-0.6b --load-format dummy --quantization int4
bench w2 100 $B.latency --model $M/llama-3-8b --load-format dummy
bench w2_fp8 100 $B.latency --model $M/llama-3-8b --load-format dummy --quantization fp8
run_step w2_det 100 $B.latency --model $M/llama-3-8b --load-format dummy --deterministic
bench w2_int4 100 $B.latency --model $M/llama-3-8b --load-format dummy --quantization int4
if (($("$PY" -c "import torch; print(torch.cuda.device_count())") >= 2)); then
  bench w2_tp2 120 $B.latency --model $M/llama-3-8b --load-format dummy --tp-size 2
fi
bench w3 90 $B.kernels
bench w3_fp8 60 $B.kernels --decode-only --decode-batches 256 --decode-contexts 1024,4096,32768 \
  --page-size 32 --kv-cache-dtype fp8_e4m3
bench moe 100 $B.moe --skip-kernels --decode-batches 1,256
bench moe_fp8 100 $B.moe --skip-kernels --decode-batches 1,256 --quantization fp8
if wants accuracy && [[ -z ${ACC_MODEL:-} ]]; then
  ACC_MODEL=$("$PY" -c "from minisgl.weights import default_model_path as p; print(p())")
fi
run_step accuracy 90 $B.accuracy --model "${ACC_MODEL:-}"
run_step hf 170 $B.offline --model $M/qwen3-0.6b --load-format dummy --engine hf \
  --hf-requests 32 --hf-timeout 100
bench spec 200 $B.speculative --algorithm ngram --concurrency 64 --num-draft-tokens 15
bench verify 100 $B.speculative --workloads none --verify-cost --model $M/llama-3-8b \
  --load-format dummy --context 128
bench structured 200 $B.structured --tokenizer "${TOKENIZER:-ggml-vocab-qwen2.gguf}"
run_step w10 300 $B.multiturn --gpu
run_step profile 240 "$PY" scripts/gpu_profile.py --parts w1,w2
summary
