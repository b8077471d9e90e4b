#!/usr/bin/env bash
# The BENCHMARKS.md suite on the hub presets, for a host with a CUDA GPU and hub access.
#
#   scripts/bench_gpu.sh [PRESET...]        (default: smollm2-1.7b qwen2.5-1.5b)
#
# Environment: PY (python, default .venv/bin/python), OUT (default bench-out/gpu), REPEATS (5),
# MAX_NEW_TOKENS (128), K (4), MTP_HEADS (a folder of MTP heads trained for the preset's target:
# adds the mtp method; python -m engine.train mtp-heads --model TARGET trains them).
# Each run writes bench.json, bench.md and charts.html under $OUT/<preset>-<run>/; the gate
# verdicts go to $OUT/<preset>-gates.txt. The script exits non-zero if any run or exact gate
# failed, or if a lossy gate passed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench-out/gpu}
REPEATS=${REPEATS:-5}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-128}
K=${K:-4}
PRESETS=("$@")
[ ${#PRESETS[@]} -eq 0 ] && PRESETS=(smollm2-1.7b qwen2.5-1.5b)

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "error: no CUDA GPU visible to torch; this suite is for GPU hosts (CPU: see BENCHMARKS.md)" >&2
  exit 2
fi
unset HF_HUB_OFFLINE  # the presets' models come from the hub
mkdir -p "$OUT"
failures=0

run() {  # run NAME ARGS...: one engine command, its status counted
  local name=$1; shift
  echo "== $name: python -m engine $*" >&2
  if ! "$PY" -m engine "$@"; then
    echo "!! $name failed" >&2
    failures=$((failures + 1))
  fi
}

gate() {  # gate PRESET EXPECT ARGS...: EXPECT is pass or fail (a lossy rule must fail)
  local preset=$1 expect=$2; shift 2
  echo "== gate ($expect expected): python -m engine gate --model $preset $*" | tee -a "$OUT/$preset-gates.txt" >&2
  "$PY" -m engine gate --model "$preset" "$@" >> "$OUT/$preset-gates.txt"
  local status=$?
  if { [ "$expect" = pass ] && [ $status -ne 0 ]; } || { [ "$expect" = fail ] && [ $status -ne 1 ]; }; then
    echo "!! gate expected to $expect, exit status $status" | tee -a "$OUT/$preset-gates.txt" >&2
    failures=$((failures + 1))
  fi
}

for preset in "${PRESETS[@]}"; do
  methods=baseline,prompt-lookup,draft-model,early-exit
  extra=()
  if [ -n "${MTP_HEADS:-}" ]; then methods+=",mtp"; extra=(--mtp-heads "$MTP_HEADS"); fi
  common=(--model "$preset" --methods "$methods" --prompts all --k "$K" --repeats "$REPEATS"
          --max-new-tokens "$MAX_NEW_TOKENS" --vs-transformers "${extra[@]}")
  run "$preset greedy" bench "${common[@]}" --out "$OUT/$preset-k$K-t0"
  run "$preset sampling" bench "${common[@]}" --temperature 0.7 --out "$OUT/$preset-k$K-t0.7"
  for k in 2 8; do
    run "$preset k=$k" bench --model "$preset" --methods "$methods" --prompts all --k "$k" --repeats "$REPEATS" \
      --max-new-tokens "$MAX_NEW_TOKENS" "${extra[@]}" --out "$OUT/$preset-k$k-t0"
  done
  : > "$OUT/$preset-gates.txt"
  for method in prompt-lookup draft-model early-exit; do
    gate "$preset" pass --method "$method" --prompts all --k "$K" --max-new-tokens 64
  done
  gate "$preset" fail --method draft-model --accept typical --prompts all --k "$K" --max-new-tokens 64
  gate "$preset" pass --method draft-model --prompts rewrite,chat --limit 2 --k "$K" --temperature 1 \
    --samples 300 --max-new-tokens 16
  gate "$preset" fail --method draft-model --accept typical --prompts rewrite,chat --limit 2 --k "$K" \
    --temperature 1 --samples 300 --max-new-tokens 16
done
echo "done: $failures failure(s); results in $OUT" >&2
[ $failures -eq 0 ]
