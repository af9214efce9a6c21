#!/usr/bin/env bash
# Issue 32's goal runs: the default policy (specdec++cost, its budget planning with the costs it
# measures) against target-only at concurrency 1 on both runtimes, HumanEval (40) and the prose test
# set (20), greedy and T = 1; on torch also against specdec++cost planned with a profile measured
# offline (SPECDEC_COST_PROFILE); then every concurrency level, in process and served.
# Resumable: each `specdec bench` skips the records its --out holds; rerun after an interruption.
# The concurrency tables are rerun whole (tens of minutes each). Say which CPU: the report records it.
# Compare only records measured together: a bench interleaves its policies prompt by prompt, and on
# this project's machines speed drifts by several percent within an hour (delete both policies'
# records of a set and temperature to remeasure them).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=docs/results/never-slower
B="specdec bench --draft default --max-new-tokens 128 --no-progress --chosen specdec++cost"
for runtime in ${RUNTIMES:-llamacpp torch}; do
  for set in "humaneval 40" "prose 20"; do
    read -r name limit <<< "$set"
    $B --runtime "$runtime" --prompts "$name" --limit "$limit" --temperatures 0 1 \
       --policies target-only specdec++cost --out "$OUT/$runtime-$name"
  done
done
if [[ " ${RUNTIMES:-llamacpp torch} " == *" torch "* ]]; then
  # the offline profile: the in-loop fit of the torch HumanEval run above (same machine)
  SPECDEC_COST_PROFILE="$OUT/torch-humaneval/results.json" $B --runtime torch --prompts humaneval --limit 40 \
    --temperatures 0 --policies target-only specdec++cost --out "$OUT/torch-humaneval-given-profile"
fi
for runtime in ${CONCURRENCY_RUNTIMES-llamacpp torch}; do  # CONCURRENCY_RUNTIMES="": none
  [[ -f "$OUT/concurrency-$runtime.json" ]] && continue
  python -m benchmarks.concurrency --runtime "$runtime" --draft default --concurrency 2 4 8 16 \
    --policies specdec++cost fixed:2 fixed:4 --out "$OUT/concurrency-$runtime.json" | tee "$OUT/concurrency-$runtime.md"
done
