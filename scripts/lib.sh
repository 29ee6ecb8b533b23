# What the GPU drivers share; they source it. Each step runs under a timeout capped by what is
# left of the call's budget, its output in $OUT/NAME.log, its exit status in $OUT/status.tsv;
# `summary` prints each step's status and the headline figures of its last JSON line.
# Environment: OUT (log folder), PY (python), BUDGET (seconds for all steps), STEPS (the steps
# to run; a step NAME.x counts as NAME), SKIP (steps not to run).
set -uo pipefail
PY=${PY:-$(command -v python || command -v python3)}
OUT=${OUT:-/tmp/minisgl-$(basename "$0" .sh)}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
M=minisgl/benchmark/models
START=$(date +%s)
: > "$OUT/status.tsv"

wants() { [[ " $STEPS " == *" ${1%%.*} "* && " ${SKIP:-} " != *" ${1%%.*} "* ]]; }

run_step() {  # run_step NAME LIMIT_S CMD...
  local name=$1 limit=$2 left t0 rc
  shift 2
  wants "$name" || return 0
  left=$((BUDGET - $(date +%s) + START))
  if ((left < 20)); then
    echo "== $name: skipped, ${left}s of the budget left"
    printf '%s\tno-time\t0\n' "$name" >> "$OUT/status.tsv"
    return 0
  fi
  ((limit > left)) && limit=$left
  echo "== $name (limit ${limit}s): $*"
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" >> "$OUT/status.tsv"
  echo "   rc=$rc in $(($(date +%s) - t0))s"
  grep -v '^{' "$OUT/$name.log" | tail -n "${TAIL:-4}" | cut -c1-200 | sed 's/^/   | /'
}

env_info() {
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
  torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO GPU')" 2>&1 | tee "$OUT/env.log"
}

summary() {
  echo "== summary (logs in $OUT, $(($(date +%s) - START))s)"
  "$PY" - "$OUT" << 'EOF'
import json, re, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
KEYS = ("output_tok_per_s", "median_itl_ms", "p99_itl_ms", "fraction_of_floor", "itl_over_floor",
        "measured_s", "server_vs_offline")
LABELS = ("batch", "context", "workload", "concurrency", "variant")
VALUES = ("fraction_of_copy", "fraction_of_floor", "speedup", "step_period_ratio",
          "perplexity_vs_baseline")
figures = {}  # (step, key) -> {side: [values]}
for line in (out / "status.tsv").read_text().splitlines():
    name, rc, secs = line.split("\t")
    log = out / f"{name}.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    jsons = [l for l in text.splitlines() if l.startswith("{")]
    shown = []
    if jsons:
        try:
            d = json.loads(jsons[-1])
        except ValueError:
            d = {}
        shown = [f"{k} {d[k]:.4g}" for k in KEYS if isinstance(d.get(k), (int, float))]
        for r in (r for k in ("decode", "workloads", "rows") for r in d.get(k) or []):
            where = "x".join(str(r[k]) for k in LABELS if k in r)
            v = next((r[k] for k in VALUES if isinstance(r.get(k), float)), None)
            shown.append(f"{where}: {v:.3g}" if v is not None else where)
        m = re.fullmatch(r"(.+?)(?:\.(this|base|ab)\d+)?", name)
        key = next((k for k in KEYS if isinstance(d.get(k), (int, float))), None)
        if m and key:
            figures.setdefault((m[1], key), {}).setdefault(m[2] or "this", []).append(d[key])
    else:
        shown = [l for l in text.splitlines() if re.search(r"\d+ (passed|failed)", l)][-1:]
    print(f"{name:14} rc={rc:7} {secs:>4}s  " + ", ".join(shown)[:300])
for (name, key), sides in sorted(figures.items()):
    if len(sides) > 1:  # A/B: medians, the first run of a side dropped when there are several
        med = {s: statistics.median(v[1:] if len(v) > 1 else v) for s, v in sides.items()}
        other = med.get("base", med.get("ab"))
        print(f"A/B {name} {key}: " + ", ".join(f"{s} {v:.4g}" for s, v in med.items())
              + f", this/other {med['this'] / other:.4f}")
EOF
}
