#!/usr/bin/env bash
# The feature draft against the 0.5B model draft end to end on the torch runtime (default target,
# greedy): each draft's own `specdec bench` with target-only interleaved prompt by prompt, so each
# draft's speedup is over target-only in its own run (compare speeds within one --out only; the
# two runs' target-only rows tell how far the machine drifted between them). The feature draft runs
# without a head (none is trained for it yet), so its policies are fixed K and svip; the 0.5B runs
# the default policy with its shipped head. Resumable: each bench skips the records its --out holds.
#   FEATURE=~/.cache/specdec/training/feature-draft/fused-1 bash benchmarks/feature_draft_runs.sh
# Say which CPU: the report records it.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/results/feature-draft}
FEATURE=${FEATURE:?the feature draft directory (specdec train-draft output)}
for set in "humaneval ${LIMIT_CODE:-10}" "prose ${LIMIT_PROSE:-5}"; do
  read -r name limit <<< "$set"
  [[ -n "${ONLY:-}" && "$name" != "$ONLY" ]] && continue
  specdec bench --runtime torch --draft "$FEATURE" --prompts "$name" --limit "$limit" --temperatures 0 \
    --policies target-only fixed:1 fixed:2 fixed:3 svip --chosen fixed:2 --max-new-tokens 128 \
    --forward-ks 1 2 4 --no-progress --out "$OUT/bench-$name-feature"
  specdec bench --runtime torch --prompts "$name" --limit "$limit" --temperatures 0 \
    --policies target-only specdec++cost fixed:3 --chosen specdec++cost --max-new-tokens 128 \
    --forward-ks 1 2 4 --no-progress --out "$OUT/bench-$name-0.5b"
done
