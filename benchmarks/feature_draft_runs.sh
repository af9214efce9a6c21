#!/usr/bin/env bash
# The feature draft against the 0.5B model draft end to end on the torch runtime (default target,
# greedy): each draft's own `specdec bench` with target-only interleaved prompt by prompt, so each
# draft's speedup is over target-only in its own run (compare speeds within one --out only; the
# two runs' target-only rows tell how far the machine drifted between them). The feature draft runs
# fixed K and svip, and the default policy (specdec++cost) where its directory holds a head
# (`specdec train-head` saves it in DIR/head); the 0.5B runs the default policy with its shipped
# head. Resumable: each bench skips the records its --out holds.
#   FEATURE=~/.cache/specdec/training/feature-draft/fused-2 bash benchmarks/feature_draft_runs.sh
#   DRAFTS=feature OUT=docs/results/feature-draft/fused-2 FEATURE=... bash ...   # the feature draft alone
#   POLICIES="target-only fixed:2 svip" ...   # the feature draft's policies besides its head's
# Say which CPU: the report records it.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/results/feature-draft}
FEATURE=${FEATURE:?the feature draft directory (specdec train-draft output)}
DRAFTS=${DRAFTS:-feature 0.5b}
read -r -a policies <<< "${POLICIES:-target-only fixed:1 fixed:2 fixed:3 svip}"
chosen=fixed:2
if [[ -f "$FEATURE/head/head.json" ]]; then
  policies+=(specdec++cost)
  chosen=specdec++cost
fi
for set in "humaneval ${LIMIT_CODE:-10}" "prose ${LIMIT_PROSE:-5}"; do
  read -r name limit <<< "$set"
  [[ -n "${ONLY:-}" && "$name" != "$ONLY" ]] && continue
  if [[ " $DRAFTS " == *" feature "* ]]; then
    specdec bench --runtime torch --draft "$FEATURE" --prompts "$name" --limit "$limit" --temperatures 0 \
      --policies "${policies[@]}" --chosen "$chosen" --max-new-tokens 128 \
      --forward-ks 1 2 4 --no-progress --out "$OUT/bench-$name-feature"
  fi
  if [[ " $DRAFTS " == *" 0.5b "* ]]; then
    specdec bench --runtime torch --prompts "$name" --limit "$limit" --temperatures 0 \
      --policies target-only specdec++cost fixed:3 --chosen specdec++cost --max-new-tokens 128 \
      --forward-ks 1 2 4 --no-progress --out "$OUT/bench-$name-0.5b"
  fi
done
