#!/usr/bin/env bash
# The feature draft against the 0.5B model draft end to end on the torch runtime (default target):
# one `specdec bench` per test set with both drafts in one engine (`--also-draft feature=...`), so
# target-only, the 0.5B's default policy and the feature draft's policies (`POLICY@feature`) run
# interleaved prompt by prompt on the same target passes and machine state. The feature draft
# runs its default policy (specdec++cost, on the head saved in its directory) and whatever
# FEATURE_POLICIES adds; the 0.5B runs its default with its shipped head. Greedy outputs are
# checked against target-only's. Resumable: each bench skips the records its --out holds.
#   bash benchmarks/feature_draft_runs.sh                                   # default-feature, T = 0 and 1
#   FEATURE=~/.cache/specdec/training/feature-draft/fused-8 OUT=... bash benchmarks/feature_draft_runs.sh
#   TEMPS=0 LIMIT_CODE=10 ONLY=humaneval FEATURE_POLICIES="fixed:2 svip" bash benchmarks/feature_draft_runs.sh
# Say which CPU: the report records it. Run it with nothing else on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/results/feature-draft/side-by-side}
FEATURE=${FEATURE:-default-feature}
read -r -a temps <<< "${TEMPS:-0 1}"
policies=(target-only specdec++cost specdec++cost@feature)
for policy in ${FEATURE_POLICIES:-}; do
  policies+=("$policy@feature")
done
for set in "humaneval ${LIMIT_CODE:-40}" "prose ${LIMIT_PROSE:-20}"; do
  read -r name limit <<< "$set"
  [[ -n "${ONLY:-}" && "$name" != "$ONLY" ]] && continue
  specdec bench --runtime torch --draft default --also-draft "feature=$FEATURE" --prompts "$name" --limit "$limit" \
    --temperatures "${temps[@]}" --policies "${policies[@]}" --chosen specdec++cost --max-new-tokens 128 \
    --forward-ks 1 2 4 --no-progress --out "$OUT/$name"
done
